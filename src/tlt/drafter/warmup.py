"""Drafter warm-up: sample responses with the target on task prompts (same chat template and prefix as RL —
EAGLE is sensitive to the prefix), collect the target's features, train, save, and measure τ with the real SD
engine on held-out prompts.

Held out by prompt: every response of the last ~10% of prompts is kept out of training. On them the warm-up
reports teacher-forced top-1 agreement and depth-1 acceptance, and the τ they predict for a greedy chain under
the target-only rule at the rollout temperature (tlt.drafter.chain): agreement alone overstates τ several-fold."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from tlt.drafter.buffer import FeatureBuffer
from tlt.drafter.chain import chain_acceptance
from tlt.drafter.features import collect_features
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer
from tlt.drafter.vocabulary import DEFAULT_DRAFT_VOCAB, frequent_tokens, limits_vocab
from tlt.errors import TltError
from tlt.files import refuse_an_unwritable_place
from tlt.lr_schedule import lr_factor
from tlt.models.eagle import CONFIG_FILE as DRAFTER_CONFIG_FILE, EagleDrafter
from tlt.models.loading import eos_token_ids
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy


# Seconds of training between saves of the drafter so far: a warm-up killed (a time limit, a lost machine) keeps
# it, weights and optimizer state, and `--init OUT` goes on from it; only the final save adds warmup_report.json.
SAVE_EVERY_S = 60.0


@dataclass(frozen=True)
class WarmupConfig:
    prompts: int = 64               # training prompts
    samples_per_prompt: int = 2
    eval_prompts: int = 8           # held-out prompts for the measured τ (0: not measured)
    max_new_tokens: int = 256
    temperature: float = 1.0        # the RL rollout temperature: the drafter learns what it will face
    steps: int = 300                # optimizer steps
    draft_vocab: int | None = None  # 0 = full vocabulary; None: --init's own, or DEFAULT_DRAFT_VOCAB for a new one
    eval_strategy: SpecStrategy = SpecStrategy(4, 2, rule="q")  # the measured τ under the rule that pays at T=1
    seed: int = 0                   # the prompts drawn and the sampling: another seed, other prompts
    init: str | None = None         # continue from this drafter (weights, draft vocabulary, optimizer state)
    lr_schedule: str = "constant"   # "constant" or "cosine" (to 10% of the lr over `steps`)

    def __post_init__(self):
        if self.lr_schedule not in ("constant", "cosine"):
            raise TltError(f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")


def warmup(loaded, task, out: str | Path, config: WarmupConfig = WarmupConfig(),
           train_config: DrafterTrainConfig = DrafterTrainConfig(), log=print, overwrite: bool = False) -> dict:
    """Sample, train, save to `out`, measure. `out` may hold a drafter only when it is `config.init` (going on
    in place) or `overwrite` is set: checked, like the --init drafter, before any sampling."""
    check_warmup(out, config, train_config, overwrite)
    check_enough_examples(getattr(task, "source", task), config)
    started = time.perf_counter()
    examples = task.sample(config.prompts + config.eval_prompts, seed=config.seed)
    train_examples, eval_examples = examples[:config.prompts], examples[config.prompts:]
    engine = RolloutEngine(loaded, max_batch_size=64)
    initial, initial_state = initial_drafter(loaded, engine.policy_forward, config)
    params = SamplingParams(temperature=config.temperature, max_new_tokens=config.max_new_tokens, seed=config.seed)
    requests = [Request(task.prompt_ids(e), n=config.samples_per_prompt, params=params) for e in train_examples]
    rollout = engine.generate(requests, progress=True)
    prompts = [list(s.prompt_ids) for s in rollout.samples]
    responses = [s.token_ids for s in rollout.samples]
    generated_s = time.perf_counter() - started
    log(f"generated {rollout.generated_tokens} tokens in {generated_s:.0f}s")

    # Held out by prompt: every response of the last prompts (~10%) is kept out of training, so the held-out
    # numbers measure prompts the drafter has never seen (holding out positions would leak their neighbours).
    held_prompts = max(1, config.prompts // 10)
    held_from = len(rollout.samples) - config.samples_per_prompt * held_prompts
    buffer = FeatureBuffer(max_tokens=10_000_000, recency=0.0, seed=config.seed)
    held_buffer = FeatureBuffer(max_tokens=10_000_000, recency=0.0, seed=config.seed)
    pairs = collect_features(engine.policy_forward, prompts[:held_from], responses[:held_from], buffer, step=0)
    collect_features(engine.policy_forward, prompts[held_from:], responses[held_from:], held_buffer, step=0)
    # the draft vocabulary from the training responses only: the held-out scores are over it
    trainer = new_trainer(loaded, initial, initial_state, engine.policy_forward, responses[:held_from], buffer,
                          config, train_config)
    drafter = trainer.drafter
    held = list(held_buffer.entries)
    saved = time.perf_counter()
    # off a terminal (a log file), a redraw every few seconds rather than one per step
    with tqdm(total=config.steps, desc="drafter warm-up", unit="step",
              mininterval=0.1 if sys.stderr.isatty() else 15.0) as bar:
        try:
            for step in range(config.steps):
                for group in trainer.optimizer.param_groups:
                    group["lr"] = train_config.lr * lr_factor(step, schedule=config.lr_schedule, warmup_steps=0,
                                                              horizon=config.steps, min_lr_ratio=0.1)
                stats = trainer.train_steps(1)[-1]
                bar.set_postfix(loss=f"{stats['loss']:.3f}", top1=f"{stats['top1']:.2f}", refresh=False)
                bar.update(1)
                if time.perf_counter() - saved >= SAVE_EVERY_S and step + 1 < config.steps:
                    trainer.save(out)  # a warm-up killed later keeps this drafter (go on with --init OUT)
                    saved = time.perf_counter()
        except KeyboardInterrupt:  # Ctrl-C (or SIGTERM, as the CLI maps it): keep the steps done. One cut inside
            # its optimizer step may be partly applied: still a valid drafter (SD is exact whatever it drafts)
            bar.close()
            trainer.save(out)
            log(f"interrupted: the drafter after {trainer.steps} optimizer step(s) is saved in {out} (go on with "
                f"--init {out}; it has no τ measurement)")
            raise
    trained_s = time.perf_counter() - started - generated_s
    trainer.save(out)  # before the scoring: one stopped while it scores kept nothing of the training (QA)
    try:
        held_out, chain, measured = _measure(trainer, engine, held, (prompts[held_from:], responses[held_from:]),
                                             [Request(task.prompt_ids(e), n=1, params=params) for e in eval_examples],
                                             config, log)
    except KeyboardInterrupt:
        log(f"interrupted while measuring: the trained drafter ({trainer.steps} optimizer steps) is saved in {out}, "
            f"without its measurements")
        raise
    report = {"pairs": pairs, "generated_tokens": rollout.generated_tokens, "generate_s": generated_s,
              "train_s": trained_s, "steps": config.steps, "held_out_prompts": held_prompts,
              "held_out_responses": len(prompts) - held_from, "held_out": held_out, "held_out_chain": chain.to_dict(),
              "measured_tau": measured["tau"], "acceptance_by_depth": measured["acceptance_by_depth"],
              "eval_strategy": config.eval_strategy.name, "draft_vocab": drafter.draft_vocab_size,
              "init": config.init, "lr_schedule": config.lr_schedule, "seed": config.seed,
              "total_s": time.perf_counter() - started}
    (Path(out) / "warmup_report.json").write_text(__import__("json").dumps(report, indent=1))
    for line in summary_lines(report, config):
        log(line)
    return report


def check_warmup(out: str | Path, config: WarmupConfig, train_config: DrafterTrainConfig, overwrite: bool) -> None:
    """Everything about a warm-up that can be refused before the model loads (`tlt drafter warmup` calls it
    first: the default model's first load takes a minute)."""
    if config.prompts < 2:
        raise TltError(f"drafter warm-up needs at least 2 prompts (one is held out), got {config.prompts}")
    if config.eval_prompts < 0:
        raise TltError(f"--eval-prompts must be >= 0 (0: no measured τ), got {config.eval_prompts}")
    check_settings(config, train_config)
    check_out(Path(out), config.init, overwrite)


def check_enough_examples(source, config: WarmupConfig) -> None:
    """A dataset draws each record once: one smaller than the training and τ prompts together left the τ
    measurement no prompt ("no requests to generate"), or the training none ("the feature buffer is empty"),
    after the sampling and with a drafter already in --out."""
    examples = getattr(source, "examples", None)
    needed = config.prompts + config.eval_prompts
    if isinstance(examples, list) and len(examples) < needed:
        room = len(examples) - config.eval_prompts
        if room < 2:  # no --prompts would do (at least 2): say what the dataset lacks
            raise TltError(f"the dataset has {len(examples)} record(s); a warm-up needs at least "
                           f"{2 + config.eval_prompts}: 2 training prompts and the {config.eval_prompts} held-out "
                           f"prompts that measure τ")
        raise TltError(f"the dataset has {len(examples)} record(s); --prompts {config.prompts} and the "
                       f"{config.eval_prompts} prompts that measure τ need {needed}: lower --prompts to at most "
                       f"{room}")


def check_settings(config: WarmupConfig, train_config: DrafterTrainConfig) -> None:
    """Values that would train nothing, or the wrong thing, without a word: refused before any sampling."""
    if config.steps < 1:
        raise TltError(f"--steps must be >= 1 (optimizer steps), got {config.steps}")
    if config.draft_vocab is not None and config.draft_vocab < 0:
        raise TltError(f"--draft-vocab must be >= 0 (0 = the full vocabulary), got {config.draft_vocab}")
    branching = config.eval_strategy.branching
    if config.draft_vocab is not None and 0 < config.draft_vocab < branching:  # found only after the training
        raise TltError(f"--draft-vocab {config.draft_vocab} is smaller than the {branching} children per node of "
                       f"{config.eval_strategy.name}, the strategy that measures τ: use at least {branching}")
    if not 0 < train_config.lr < math.inf:
        raise TltError(f"--lr must be a finite number > 0, got {train_config.lr}")
    if not 0 <= train_config.ce_weight < math.inf:
        raise TltError(f"--ce-weight must be a finite number >= 0, got {train_config.ce_weight}")


def _measure(trainer, engine, held: list, held_pairs: tuple, eval_requests: list, config, log):
    """(teacher-forced scores on the held-out features `held`, the greedy chains' acceptance on the held-out
    (prompts, responses), the τ of SD at batch 1 on `eval_requests`) of the trained drafter."""
    drafter = trainer.drafter
    held_out = trainer.evaluate(held)
    held_prompts, held_responses = held_pairs
    log(f"scoring greedy draft chains on the {len(held_prompts)} held-out responses")
    chain = chain_acceptance(drafter, engine.policy_forward, held_prompts, held_responses,
                             config.eval_strategy.depth, config.temperature)
    engine.set_drafter(drafter)
    engine.max_tree_size = config.eval_strategy.cache_slots
    engine.speculation = config.eval_strategy
    engine.max_batch_size = 1
    measured = {"tau": None, "acceptance_by_depth": None}
    if eval_requests:  # (--eval-prompts 0: a quick warm-up skips the slowest part of a small one)
        log(f"measuring τ: speculative decoding at batch 1 on {len(eval_requests)} held-out prompts")
        measured = engine.generate(eval_requests, progress=True).speculation_summary()
    return held_out, chain, measured


def _tau_text(tau: float | None) -> str:
    return "none (every response ended at its first token: no speculative step ran)" if tau is None else f"{tau:.2f}"


def check_out(out: Path, init: str | None, overwrite: bool) -> None:
    refuse_an_unwritable_place(out, "--out")
    if (out / "config.json").exists():  # a model's directory (or an export's): the drafter would be mixed into it
        raise TltError(f"{out} holds a config.json (a model's directory?): a drafter goes into a directory of its "
                       f"own; choose another --out")
    same_as_init = init is not None and Path(init).resolve() == out.resolve()
    if (out / DRAFTER_CONFIG_FILE).exists() and not (overwrite or same_as_init):
        raise TltError(f"{out} already holds a drafter: pass --overwrite to replace it, --init {out} to go on "
                       f"training it, or another --out")


def initial_drafter(loaded, forward, config: WarmupConfig) -> tuple[EagleDrafter | None, dict | None]:
    """The drafter of config.init and its trainer state (None: it has none), both read and checked before any
    sampling (a damaged file fails now, not after it); (None, None) for a fresh drafter."""
    if config.init is None:
        return None, None
    drafter = EagleDrafter.load(config.init, forward)
    state = DrafterTrainer.saved_state(config.init) if DrafterTrainer.has_saved_state(config.init) else None
    vocab = loaded.spec.vocab_size
    if config.draft_vocab is None:  # not asked: the drafter keeps its own
        return drafter, state
    wanted = config.draft_vocab if limits_vocab(config.draft_vocab, vocab) else vocab
    if drafter.draft_vocab_size != wanted:
        raise TltError(f"--init {config.init} has a draft vocabulary of {drafter.draft_vocab_size} tokens, not the "
                       f"{wanted} asked for: pass --draft-vocab {drafter.draft_vocab_size} (a drafter keeps its own)")
    return drafter, state


def new_trainer(loaded, drafter: EagleDrafter | None, state: dict | None, forward, responses, buffer,
                config: WarmupConfig, train_config: DrafterTrainConfig) -> DrafterTrainer:
    """A trainer of the --init drafter with its optimizer moments (a warm-up going on from where another
    stopped, on new prompts), or of a fresh drafter over the responses' most frequent tokens."""
    if drafter is not None:
        trainer = DrafterTrainer(drafter, buffer, train_config)
        if state is not None:
            trainer.load_optimizer(config.init, state)
        return trainer
    vocab = loaded.spec.vocab_size
    size = DEFAULT_DRAFT_VOCAB if config.draft_vocab is None else config.draft_vocab
    stops = eos_token_ids(loaded.model, loaded.tokenizer)  # every response's last token, however rare
    draft_vocab = frequent_tokens(responses, size, vocab, always=stops) if limits_vocab(size, vocab) else None
    return DrafterTrainer(EagleDrafter(loaded.model.config, draft_vocab).attach(forward), buffer, train_config)


def summary_lines(report: dict, config: WarmupConfig) -> list[str]:
    """What the warm-up measured, each number named for what it is (and what it is not)."""
    held, chain, temp = report["held_out"], report["held_out_chain"], config.temperature
    rule = "q-sampling" if config.eval_strategy.rule == "q" else "target-only"
    reach = " ".join(f"{r:.2f}" for r in chain["reach_by_depth"])
    return [
        (f"held out: all {report['held_out_responses']} responses of {report['held_out_prompts']} prompt(s), "
         f"never trained on"),
        (f"  top-1 agreement with the target's argmax (teacher-forced): {held['top1']:.3f}, not an acceptance rate "
         f"at T={temp}"),
        (f"  depth-1 acceptance at T={temp} (teacher-forced, over the draft vocabulary): target-only E[p(argmax q)] "
         f"{held['accept_target_only']:.3f}, q-sampling E[sum min(p, q)] {held['accept_q']:.3f}"),
        (f"  predicted τ of a greedy depth-{chain['depth']} chain, target-only rule, T={temp}: {chain['tau']:.2f} "
         f"(reaches depth 1..{chain['depth']} with probability {reach}; {chain['chains']} chains)"),
        (f"measured τ of SD in the engine ({report['eval_strategy']}, {rule} rule, T={temp}, batch 1, "
         f"{config.eval_prompts} other held-out prompts): "
         f"{_tau_text(report['measured_tau']) if config.eval_prompts else 'not measured (--eval-prompts 0)'}; "
         f"warm-up took "
         f"{report['total_s'] / 60:.1f} min"),
    ]
