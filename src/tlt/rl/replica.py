"""PolicyReplica: one copy of the policy and everything a step's phases use with it.

The model, its rollout engine (which reads the model's own parameter tensors, so an update is seen by the next
rollout without a copy), the optimizer and lr schedule, the frozen KL reference, the task and the reward. The
in-process driver (GRPOTrainer) holds one; every distributed worker holds its own. The phases (rl/phases.py)
take it as their explicit input; no phase keeps state on it beyond what training changes (weights, optimizer,
schedule, the speculation policy's experience).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from dataclasses import dataclass

import torch

from tlt.drafter.vocabulary import frequent_tokens, limits_vocab
from tlt.errors import RequestError
from tlt.models.eagle import EagleDrafter
from tlt.models.loading import LoadedModel, eos_token_ids, load_model
from tlt.rl.config import TrainConfig
from tlt.rl.config_checks import check_speculation
from tlt.rl.optim import (autocast_dtype, build_optimizer, build_scheduler, disable_dropout,
                          enable_grad_checkpointing)
from tlt.rl.rewards import build_reward
from tlt.rollout.cost_curve import EXPECTED_TAU, curve_for
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.policy import AdaptiveSpeculation, BatchSizeGate, FixedSpeculation
from tlt.rollout.request import Request, check_fits
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy
from tlt.tasks import ChatTask, DatasetTask, build_task
from tlt.tasks.example import TaskExample, record_label

# BPE merges across the chat template's edges could, in principle, cost a token or two more than the two parts
# counted apart: a margin before trusting the byte bound
TEMPLATE_SLACK = 8
GENERATED_SAMPLE = 16  # prompts of a generated task checked before step 1
PROMPTS_FOR_VOCAB = 512  # task prompts a drafter trained from scratch takes its draft vocabulary from

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PolicyReplica:
    config: TrainConfig
    loaded: LoadedModel
    device: torch.device
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # one step per RL step; checkpointed
    autocast_dtype: torch.dtype | None  # of the training and log-prob forwards (None: full precision)
    reference: torch.nn.Module | None   # the initial policy, frozen (only with grpo.kl_coef > 0)
    task: object
    reward: object
    reference_digest: str | None = None  # of the reference's weights: --resume checks the model is still the one

    @classmethod
    def build(cls, config: TrainConfig, *, loaded: LoadedModel | None = None, task=None, reward=None,
              announce: bool = True):
        """Load (or take) the model and build the rest from the config. Seeded first: an untrained drafter's
        initialization draws from torch's generator, so equal seeds give equal replicas. `announce=False` keeps
        the notes every replica of a run would print alike (data-parallel workers after the first) quiet."""
        torch.manual_seed(config.run.seed)
        loaded = loaded or load_model(config.model.path, device=config.model.device)
        model = loaded.model
        device = next(model.parameters()).device
        task = task if task is not None else build_task(config.task, loaded.tokenizer)
        check_prompts_fit(task, loaded.spec, config.rollout.max_new_tokens)  # before the cost curve's minute
        if disable_dropout(model) and announce:
            log.warning("the policy's dropout is set to 0 for RL: its old and new log-probs come from one forward")
        engine = build_engine(loaded, config, task=task, announce=announce)
        optimizer = build_optimizer(model, config.optim)
        scheduler = build_scheduler(optimizer, config)
        if config.optim.grad_checkpointing:
            enable_grad_checkpointing(model)
        reference = _frozen_copy(model) if config.grpo.kl_coef > 0 else None
        return cls(config, loaded, device, engine, optimizer, scheduler,
                   autocast_dtype(config.optim.autocast, device), reference,
                   task, reward if reward is not None else build_reward(config.task),
                   weights_digest(reference) if reference is not None else None)

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def lr(self) -> float:
        """The learning rate the last update used (the schedule's value for its step)."""
        return self.optimizer.param_groups[0]["lr"]


def check_prompts_fit(task, spec, max_new_tokens: int) -> None:
    """Prompts fit the context with the response budget before step 1: the engine checks a request only when a
    step samples it, which may be hours into the run (or a minute, after the cost curve). A dataset's every
    prompt (held-out ones too); a generated task's sample of them, which shows a budget that leaves no room.
    A prompt takes at most one token per UTF-8 byte (byte-level and byte-fallback vocabularies) beyond its chat
    template's own tokens, so only the prompts long enough to be in doubt are tokenized: a million-prompt dataset
    costs a pass over its strings."""
    source = getattr(task, "source", None)
    longest = None
    if isinstance(source, DatasetTask):
        examples = [*source.examples, *task.eval_examples]
    elif isinstance(task, ChatTask):
        examples = task.sample(GENERATED_SAMPLE, seed=0)
        # a generator that knows its longest text, checked after the sample (a budget no sampled prompt fits
        # is the budget's fault, not task.max_operations'): one drawn hours in stopped a run (QA)
        longest = getattr(source, "longest_problem", lambda: None)()
    else:
        return  # a task given in code: its prompts are its owner's, and the engine checks each request
    template = len(task.prompt_ids(TaskExample("", "")))
    if template + max_new_tokens > spec.max_positions:  # no prompt fits: it is not any one prompt's fault
        what = "task.system_prompt" if task.system_prompt else "the chat template"
        raise RequestError(f"{what}: an empty prompt already takes {template} tokens, + max_new_tokens "
                           f"{max_new_tokens} = {template + max_new_tokens} exceeds the model's context of "
                           f"{spec.max_positions}{spec.context_note}: no prompt fits")
    room = spec.max_positions - max_new_tokens - template - TEMPLATE_SLACK
    params = SamplingParams(max_new_tokens=max_new_tokens)
    byte_length = _normalized_byte_length(task.tokenizer)
    labelled = [(example, record_label(example) or "a task prompt") for example in examples]
    if longest is not None:
        labelled.append((longest, f"the built-in task's longest prompt (task.max_operations="
                                  f"{longest.meta['operations']}; it draws such prompts rarely)"))
    for example, label in labelled:
        if byte_length is None or byte_length(example.prompt) > room:
            request = Request(task.prompt_ids(example), params=params)
            check_fits(request, spec.vocab_size, spec.max_positions, label, spec.context_note)


def _normalized_byte_length(tokenizer):
    """The byte bound holds for the text the tokenizer's model sees, after its normalizer, and a normalizer can
    lengthen text (NFKC turns one 3-byte ligature into 33 bytes; NFC recomposes some scripts longer). None when
    the normalizer cannot be read (a slow tokenizer): then every prompt is tokenized."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    normalizer = backend.normalizer
    if normalizer is None:
        return lambda text: len(text.encode())
    return lambda text: len(normalizer.normalize_str(text).encode())


# run.* keys that only speculative decoding reads (run.drafter has its own warning)
# (not run.tail_training: off, with no drafter, is what turns speculation off on one worker: distributed/placement.py)
SPECULATION_KEYS = ("strategy", "gate", "draft_vocab", "tail_decode_priority", "publish_every",
                    "swap_poll_s", "drafter_lr", "drafter_lr_ramp", "publish_gate", "drafter_cuda_graph",
                    "drafter_buffer_tokens")


def unused_speculation_settings(run) -> list[str]:
    """`run.KEY=value` of each speculation-only setting changed from its default (found by QA: run.speculative=off
    with run.strategy=... ran without a word)."""
    default = type(run)()
    return [f"run.{key}={getattr(run, key)}" for key in SPECULATION_KEYS if getattr(run, key) != getattr(default, key)]


def build_engine(loaded, config: TrainConfig, *, task=None, announce: bool = True) -> RolloutEngine:
    """The rollout engine for a run mode. Every mode shares the rest of the step, so comparisons are fair.
    `task`: where a drafter trained from scratch takes its draft vocabulary from (its prompts)."""
    run, batch = config.run, config.rollout.max_batch_size
    check_speculation(run)  # load_config checked it already; a config built in code may not have been
    # cuda_graphs=None: the engine captures graphs when its model is on CUDA (false: never)
    precision = {"dtype": config.rollout.dtype, "cuda_graphs": None if config.rollout.cuda_graphs else False}
    if config.rollout.compile != "off" and loaded.model.device.type == "cuda":
        precision["compile"] = config.rollout.compile
    elif config.rollout.compile != "off":  # kept, not refused: one config serves the GPU and the CPU machines
        log.warning("rollout.compile=%s is ignored on %s: it compiles the steps CUDA graphs replay",
                    config.rollout.compile, loaded.model.device.type)
    if loaded.model.device.type == "cuda":
        precision["kernels"] = config.rollout.kernels  # auto: Triton's unless compiled (`resolve_kernels`)
    elif config.rollout.kernels == "triton":  # as compile: kept for the GPU machines, the CPU runs torch's
        log.warning("rollout.kernels=%s is ignored on %s: the Triton kernels run on CUDA",
                    config.rollout.kernels, loaded.model.device.type)
    if run.speculative == "off":
        if run.drafter:  # not refused: an A/B pair of configs may differ in run.speculative alone
            log.warning("run.drafter=%s is not used: run.speculative=off decodes without a drafter", run.drafter)
        unused = unused_speculation_settings(run)
        if unused and announce:  # (once: rank 0 announces, the other workers build quietly)
            log.warning("%s not used: run.speculative=off decodes without speculation", ", ".join(unused))
        return RolloutEngine(loaded, max_batch_size=batch, **precision)
    if run.drafter:
        drafter = EagleDrafter.load(run.drafter, loaded.model)
    else:  # untrained: spot training teaches it (an engine serves it no SD step until a trained version comes)
        drafter = fresh_drafter(loaded, task, run.draft_vocab)
    strategy = SpecStrategy.parse(run.strategy)
    if run.speculative == "static":
        arms = [strategy]
    else:
        # Both acceptance rules compete: q-sampling wins where the drafter's q is close to p (1 - TV(p, q) per
        # token), target-only where its trees are cheaper to verify (N = 8 or 16 instead of K + (S - 1) K^2).
        # q chains of depth 3 and 5: the best at batch 2 and batch 1 on the CPU with a warmed drafter (depth 4
        # lost to both, docs/benchmarks.md §3); depth 5 is also the chain a GPU verifies for about one token.
        arms = list(dict.fromkeys([SpecStrategy.chain(3), strategy, SpecStrategy(5, 3, 16),
                                   SpecStrategy.chain(3, "q"), SpecStrategy.chain(5, "q"),
                                   SpecStrategy(3, 2, rule="q")]))
    engine = RolloutEngine(loaded, max_batch_size=batch, drafter=drafter,
                           max_tree_size=max(a.cache_slots for a in arms), **precision)
    engine.drafter_trained = bool(run.drafter)  # every driver's engine, until a worker sets a trained version
    gate, arms = _gate_and_arms(engine, run, arms, announce)
    if gate == 0:
        return engine  # speculation cannot pay on this device: plain decoding (the drafter is kept for metrics)
    if run.speculative == "static":
        engine.speculation = FixedSpeculation(strategy, gate)
    else:
        curve = engine.cost_curve  # (run.gate=auto) prices each arm's step: no forced trials of a losing arm
        price = None if curve is None else (lambda arm, batch: curve.cost(arm.name, batch))
        engine.speculation = AdaptiveSpeculation(arms, BatchSizeGate(threshold=gate), price=price)
    return engine


def fresh_drafter(loaded, task, draft_vocab: int) -> EagleDrafter:
    """An untrained drafter over `draft_vocab` tokens (0: the whole vocabulary): the most frequent of the task's
    prompts as the rollout sees them (no response exists yet), topped up with the lowest ids, the stop tokens
    always in. Deterministic, so every replica of a run builds the same one."""
    vocab_size = loaded.spec.vocab_size
    ids = None
    if limits_vocab(draft_vocab, vocab_size):
        stops = eos_token_ids(loaded.model, loaded.tokenizer)
        ids = frequent_tokens(_prompt_token_ids(task), draft_vocab, vocab_size, always=stops)
    return EagleDrafter(loaded.model.config, ids).attach(loaded.model)


def _prompt_token_ids(task) -> list[list[int]]:
    """Token ids of a fixed, seeded sample of the task's prompts ([] for no task, or a task given in code that
    cannot be sampled: the vocabulary is then the stop tokens and the lowest ids). A task given in code is asked
    in draws of 16: one of a few records may not hold 512, and its draw must not stop the run."""
    if not (hasattr(task, "sample") and hasattr(task, "prompt_ids")):
        return []
    try:
        if isinstance(task, ChatTask):  # a dataset's draw is seeded, without replacement (files may be ordered)
            examples = task.sample(PROMPTS_FOR_VOCAB, seed=0)
        else:
            examples = [e for seed in range(PROMPTS_FOR_VOCAB // 16) for e in task.sample(16, seed=seed)]
        return [list(task.prompt_ids(example)) for example in examples]
    except Exception as error:  # noqa: BLE001 - a task's own sampling: the lowest ids serve instead
        log.warning("the drafter's vocabulary is the stop tokens and the lowest ids: sampling the task's prompts "
                    "failed (%s: %s)", type(error).__name__, error)
        return []


def _gate_and_arms(engine: RolloutEngine, run, arms: list, announce: bool) -> tuple[int, list]:
    """The configured gate, or with `run.gate=auto` the one the device's measured cost curve gives (cached per
    device, model and arms; see rollout/cost_curve.py), with the arms that can pay there."""
    if run.gate != "auto":
        return int(run.gate), arms
    curve = curve_for(engine, arms)
    engine.cost_curve = curve
    kept = [a for a in arms if a.name in curve.arms()]
    gate = curve.gate() if kept else 0
    if announce:
        _announce_gate(curve, gate, kept, arms)
    return gate, kept


def _announce_gate(curve, gate: int, kept: list, arms: list) -> None:
    if gate == 0:
        log.warning("run.gate=auto: on %s no speculation arm is expected to pay (a step of the cheapest costs "
                    "%.2fx a plain step at batch 1, expected tau %.1f): decoding without speculation; set run.gate "
                    "to a batch size to speculate anyway", curve.device,
                    min(curve.ratio(a.name, curve.batches[0]) for a in arms), EXPECTED_TAU)
    else:
        log.info("run.gate=auto: speculate at batch <= %d on %s with %s", gate, curve.device,
                 ", ".join(a.name for a in kept))


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a model's tensors in order (shapes, dtypes, bytes; not their names, which a transformers
    release may rename): the same weights loaded anew, on any device, give the same digest (~0.3 s per GB)."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model).eval()
    for param in reference.parameters():
        param.requires_grad_(False)
    return reference
