"""GRPO with verifiable rewards: the RL step that TLT accelerates.

One step reads top to bottom: sample prompts → rollout (n samples per prompt) → rewards → group-normalized
advantages → PPO-clip update over micro-batches with gradient accumulation and clipping. With one optimizer update
per step (the default) the old log-probs equal the update's own, so no separate old-log-prob forward runs: the
ratio is exp(logp - logp.detach()) (value 1, the policy gradient), as in TRL. With several updates per step the
old log-probs are recomputed by the actor (no grad) before the first one. The rollout engine shares the policy's
parameter tensors, so the update is seen by the next rollout with no weight copy. Every random choice derives
from (run seed, step), so a resumed run repeats exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tlt.models.eagle import EagleDrafter
from tlt.models.loading import LoadedModel, load_model
from tlt.rl.actor import PackedSamples, actor_hidden, token_logprobs
from tlt.rl.checkpoint import load_checkpoint, save_checkpoint, save_final_model
from tlt.rl.config import TrainConfig, check_speculation
from tlt.rl.grpo import group_advantages, policy_loss
from tlt.rl.optim import (advance_schedule, autocast_dtype, build_optimizer, build_scheduler,
                          enable_grad_checkpointing, training_autocast)
from tlt.rl.rewards import build_reward
from tlt.rollout.cost_curve import EXPECTED_TAU, curve_for
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.policy import AdaptiveSpeculation, BatchSizeGate, FixedSpeculation
from tlt.rollout.replay import length_matched, regroup
from tlt.rollout.request import Request, RolloutResult
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy
from tlt.tasks import build_task


@dataclass
class StepBatch:
    """Everything one RL step learns from, flattened sample-major (prompt p's samples are rows p*n .. p*n+n-1)."""

    packed: PackedSamples
    rewards: torch.Tensor        # [N]
    correct: torch.Tensor        # [N] bool
    advantages: torch.Tensor     # [N]
    old_logprobs: torch.Tensor | None  # [N, L - 1]; None: on-policy, the update's own log-probs (detached)
    ref_logprobs: torch.Tensor | None
    # Micro-batches (in update order) whose drafter features are already in the feature buffer; the update's
    # forward adds those of the rest. None: nothing to collect (no buffer, or the old-log-prob pass did it).
    features_done: int | None = None


class GRPOTrainer:
    def __init__(self, config: TrainConfig, *, loaded: LoadedModel | None = None, task=None, reward=None,
                 feature_buffer=None):
        self.config = config
        torch.manual_seed(config.run.seed)
        self.loaded = loaded or load_model(config.model.path, device=config.model.device)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.device = next(self.model.parameters()).device
        self.engine = build_engine(self.loaded, config)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config)  # per RL step; checkpointed
        if config.optim.grad_checkpointing:
            enable_grad_checkpointing(self.model)
        self.autocast_dtype = autocast_dtype(config.optim.autocast, self.device)  # training/log-prob forwards
        self.reference = self._frozen_reference() if config.grpo.kl_coef > 0 else None
        self.task = task if task is not None else build_task(config.task, self.tokenizer)
        self.reward = reward if reward is not None else build_reward(config.task)
        # When set, the drafter's FeatureBuffer is fed from a forward the step runs anyway (the old-log-prob pass,
        # or the update's own forward when that pass is skipped): no extra forward.
        self.feature_buffer = feature_buffer
        self.progress = False  # a rollout progress bar (the CLI turns it on)
        self.on_phase = None   # callable(text): the driver's status line, told when the rollout is over
        self.step = 0

    # -- one RL step ----------------------------------------------------------------------------------

    def train_step(self) -> dict:
        started = time.perf_counter()
        examples = self.task.sample(self.config.rollout.prompts_per_step, seed=self.step_seed())
        rollout = self.rollout(examples)
        rollout_s = time.perf_counter() - started
        if self.on_phase is not None:
            self.on_phase(f"step {self.step + 1}: log-probs and update")
        batch = self.score(examples, rollout)
        update = self.update(batch)
        self.step += 1
        metrics = self._metrics(rollout, batch.rewards, batch.correct, update, rollout_s,
                                time.perf_counter() - started - rollout_s)
        if not self.evaluation_due():
            return metrics
        if self.on_phase is not None:
            self.on_phase(f"step {self.step}: held-out evaluation")
        return {**metrics, **self.evaluate()}

    def evaluation_due(self) -> bool:
        return bool(getattr(self.task, "eval_examples", None)) and evaluation_due(self.config, self.step)

    def evaluate(self) -> dict:
        """Greedy accuracy and mean reward on the held-out examples (decoded like a rollout, without noise)."""
        started = time.perf_counter()
        examples = self.task.eval_examples
        params = SamplingParams(temperature=0, max_new_tokens=self.config.rollout.max_new_tokens)
        self.model.eval()
        # Plain decoding: greedy SD emits the same tokens, but its observations would feed the bandit (whose
        # τ estimates are for the rollout temperature) and its numerics would depend on the drafter version.
        speculation, self.engine.speculation = self.engine.speculation, None
        try:
            result = self.engine.generate([Request(self.task.prompt_ids(e), params=params) for e in examples])
        finally:
            self.engine.speculation = speculation
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in result.samples]
        scored = self.reward.score(texts, [examples[s.request_index] for s in result.samples])
        return {"eval_accuracy": sum(scored.correct) / len(examples),
                "eval_reward_mean": sum(scored.rewards) / len(examples), "eval_s": time.perf_counter() - started}

    def step_seed(self) -> int:
        return self.config.run.seed * 1_000_003 + self.step

    def rollout(self, examples, between_steps=None, lengths=None, collect_features=None) -> RolloutResult:
        """`lengths` (one per sample, prompt-major): an equal-work replay, every sample decodes exactly its
        length with stop tokens ignored (rollout/replay.py; benchmarks only). `between_steps` and
        `collect_features`: see `RolloutEngine.generate`."""
        cfg = self.config.rollout
        params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                max_new_tokens=cfg.max_new_tokens, seed=self.step_seed())
        requests = [Request(self.task.prompt_ids(example), n=cfg.samples_per_prompt, params=params)
                    for example in examples]
        self.model.eval()
        if self.engine.speculation is not None:
            self.engine.speculation.reset()  # the batch restarts large: the gate closes again
        hooks = dict(progress=self.progress, between_steps=between_steps, collect_features=collect_features)
        if lengths is None:
            return self.engine.generate(requests, **hooks)
        return regroup(self.engine.generate(length_matched(requests, lengths), **hooks), requests)

    def score(self, examples, rollout: RolloutResult) -> StepBatch:
        n = self.config.rollout.samples_per_prompt
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in rollout.samples]
        scored = self.reward.score(texts, [examples[s.request_index] for s in rollout.samples])
        rewards = torch.tensor(scored.rewards, dtype=torch.float32)
        advantages = group_advantages(rewards.view(-1, n), scale_rewards=self.config.grpo.scale_rewards).view(-1)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        packed = PackedSamples.build([list(s.prompt_ids) for s in rollout.samples],
                                     [s.token_ids for s in rollout.samples], pad, self.device)
        # Several updates per step move the policy between them: the ratio then needs the log-probs of the policy
        # that sampled. With one update they would equal the update's own, so that forward is skipped.
        old = self._no_grad_logprobs(self.model, packed) if self.config.grpo.updates_per_step > 1 else None
        ref = self._no_grad_logprobs(self.reference, packed) if self.reference is not None else None
        self.reward_failures = scored.failures
        pending = 0 if self.feature_buffer is not None and old is None else None
        return StepBatch(packed, rewards, torch.tensor(scored.correct), advantages.to(self.device), old, ref,
                         features_done=pending)

    def _no_grad_logprobs(self, model, packed: PackedSamples) -> torch.Tensor:
        out = torch.zeros(packed.input_ids.shape[0], packed.input_ids.shape[1] - 1, device=self.device)
        collect = self.feature_buffer is not None and model is self.model
        with torch.no_grad(), training_autocast(self.autocast_dtype, self.device):
            for chunk in self.micro_batches(packed):
                micro = packed.select(chunk)
                actor = token_logprobs(model, micro, self.config.rollout.temperature, want_hidden=collect)
                out[chunk, :actor.logprobs.shape[1]] = actor.logprobs
                if collect:
                    self._add_features(micro, actor.hidden)
        return out

    def collect_features(self, batch: StepBatch, should_stop=lambda: False) -> int:
        """Feed the feature buffer now, micro-batch by micro-batch, with a forward of the decoder alone, until
        `should_stop()`; the update's forward collects the rest. A worker idle in other workers' tail calls it,
        so that spot training has this step's features at once. Returns the micro-batches collected."""
        if batch.features_done is None:
            return 0
        chunks = self.micro_batches(batch.packed)
        self.model.eval()
        with torch.no_grad(), training_autocast(self.autocast_dtype, self.device):  # as the other feature forwards
            while batch.features_done < len(chunks) and not should_stop():
                micro = batch.packed.select(chunks[batch.features_done])
                self._add_features(micro, actor_hidden(self.model, micro))
                batch.features_done += 1
        return batch.features_done

    def micro_batches(self, packed: PackedSamples) -> list[list[int]]:
        """Row indices, `optim.micro_batch_size` at a time, longest rows first: rows of similar lengths share a
        micro-batch, so less of each forward is padding. The loss is normalized by whole-step totals, so the
        grouping does not change it (or the gradient) beyond float rounding."""
        lengths = [p + r for p, r in zip(packed.prompt_lengths, packed.response_lengths)]
        rows = sorted(range(len(lengths)), key=lambda row: -lengths[row])  # stable: ties keep their order
        return list(_chunks(rows, self.config.optim.micro_batch_size))

    def _add_features(self, micro: PackedSamples, hidden: torch.Tensor) -> None:
        starts, ends = micro.feature_spans()
        self.feature_buffer.add_samples(micro.input_ids, hidden.detach(), starts, ends, self.step)

    def loss_totals(self, batch: StepBatch) -> dict:
        """The loss normalizers of this batch; data-parallel workers sum theirs so every shard's loss is
        normalized by the global batch (then summed gradients equal the single-worker gradient)."""
        return {"tokens": float(batch.packed.response_mask.sum()), "sequences": float(batch.rewards.shape[0]),
                "max_tokens": float(self.config.rollout.max_new_tokens)}

    def update(self, batch: StepBatch, totals: dict | None = None, reduce_gradients=None) -> dict:
        """PPO-clip over micro-batches; each micro-batch's loss is weighted so the accumulated gradient equals
        the full-batch loss's gradient (micro 1 x accumulation 8 == micro 8 x accumulation 1).
        `reduce_gradients(parameters)` (data parallel) sums the gradients across replicas before clipping."""

        cfg, grpo = self.config.optim, self.config.grpo
        if batch.old_logprobs is None and grpo.updates_per_step > 1:
            raise ValueError("a batch scored without old log-probs allows one update per step only")
        totals = totals or self.loss_totals(batch)
        self.model.train()
        stats: dict[str, list[float]] = {}
        grad_norms = []
        advance_schedule(self.scheduler, self.step)  # this step's lr (all its passes share it)
        for _ in range(grpo.updates_per_step):
            self.optimizer.zero_grad(set_to_none=True)
            for index, chunk in enumerate(self.micro_batches(batch.packed)):
                micro = batch.packed.select(chunk)
                width = micro.response_mask.shape[1]
                collect = batch.features_done is not None and index >= batch.features_done
                with training_autocast(self.autocast_dtype, self.device):
                    actor = token_logprobs(self.model, micro, self.config.rollout.temperature, want_hidden=collect)
                if collect:  # the skipped old-log-prob pass would have fed the buffer: this forward does
                    self._add_features(micro, actor.hidden)
                logprobs = actor.logprobs
                old = batch.old_logprobs[chunk, :width] if batch.old_logprobs is not None else logprobs.detach()
                ref = batch.ref_logprobs[chunk, :width] if batch.ref_logprobs is not None else None
                loss, parts = policy_loss(grpo.loss, logprobs, old, batch.advantages[chunk], micro.response_mask,
                                          totals, clip_low=grpo.clip_low, clip_high=grpo.clip_high,
                                          ref_logprobs=ref, kl_coef=grpo.kl_coef)
                loss.backward()
                for key, value in parts.items():
                    stats.setdefault(key, []).append(float(value))
            if reduce_gradients is not None:
                reduce_gradients([p for p in self.model.parameters() if p.requires_grad])
            if cfg.grad_clip > 0:
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)))
            self.optimizer.step()
            if batch.features_done is not None:  # every micro-batch's features are in now
                batch.features_done = None
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        summary = {key: statistics.fmean(values) for key, values in stats.items()}
        summary["loss"] = sum(stats.get("loss", [0.0]))
        if grad_norms:
            summary["grad_norm"] = statistics.fmean(grad_norms)
        return summary

    # -- metrics and helpers ----------------------------------------------------------------------------

    def _metrics(self, rollout: RolloutResult, rewards: torch.Tensor, correct: torch.Tensor, update: dict,
                 rollout_s: float, train_s: float) -> dict:
        return {**step_metrics(rollout, rewards, correct, update, rollout_s, train_s, self.reward_failures),
                **self.policy_metrics(), "lr": self.optimizer.param_groups[0]["lr"]}

    def policy_metrics(self) -> dict:
        """τ and tokens/s per arm of the adaptive policy (cumulative over the run: it carries across steps)."""
        metrics = {}
        curve = self.engine.cost_curve
        if curve is not None:  # run.gate=auto: what the device's cost curve decided
            metrics["sd/gate"] = curve.gate()
            metrics.update({f"sd/cost_ratio_b1/{arm}": curve.ratio(arm, curve.batches[0]) for arm in curve.step_s})
        policy = self.engine.speculation
        arms = policy.summary().get("arms", {}) if policy is not None else {}
        return {**metrics, **{f"sd/arm/{name}/{key}": value for name, stats in arms.items()
                              for key, value in stats.items()}}

    def _frozen_reference(self):
        reference = copy.deepcopy(self.model).eval()
        for param in reference.parameters():
            param.requires_grad_(False)
        return reference

    def save(self, run_dir: Path, extra: dict | None = None, files: dict | None = None) -> Path:
        """The one checkpoint writer of a run (workers add their drafter as `extra` and `files`)."""
        extra = {**(extra or {}), "config": self.config.to_dict()}
        if self.engine.speculation is not None:  # the bandit's experience carries across steps
            extra["speculation"] = self.engine.speculation.state_dict()
        optimizer = self.optimizer if self.config.run.save_optimizer else None
        return save_checkpoint(run_dir, self.step, self.model, optimizer, extra, files=files,
                               scheduler=self.scheduler)

    def save_final(self, directory: Path) -> Path:
        return save_final_model(self.model, self.tokenizer, directory)

    def resume(self, checkpoint: Path) -> None:
        state = load_checkpoint(checkpoint, self.model, self.optimizer, self.scheduler)
        self.step = state["step"]
        if "speculation" in state and self.engine.speculation is not None:
            self.engine.speculation.load_state_dict(state["speculation"])


def evaluation_due(config: TrainConfig, step: int) -> bool:
    """After step `step`: every task.eval_every steps and after the last one (with a held-out set)."""
    return step % config.task.eval_every == 0 or step == config.run.steps


def step_metrics(rollout: RolloutResult, rewards: torch.Tensor, correct: torch.Tensor, update: dict,
                 rollout_s: float, train_s: float, reward_failures: int) -> dict:
    """What a step's metrics line and metrics.jsonl report: learning, lengths, time, the long tail, SD."""
    lengths = sorted(len(s.token_ids) for s in rollout.samples)
    decode_batches = rollout.batch_size_trace()
    return {
        "reward_mean": float(rewards.mean()),
        "accuracy": float(correct.float().mean()),
        "response_len_mean": statistics.fmean(lengths),
        "response_len_p50": _percentile(lengths, 50),
        "response_len_p90": _percentile(lengths, 90),
        "response_len_max": lengths[-1],
        "truncated_fraction": sum(s.finish_reason == "length" for s in rollout.samples) / len(lengths),
        "rollout_s": rollout_s,
        "train_s": train_s,
        "rollout_tok_s": rollout.generated_tokens / rollout_s if rollout_s > 0 else 0.0,
        "decode_steps": len(decode_batches),
        "tail_steps_fraction": (sum(b <= max(decode_batches) // 4 for b in decode_batches) / len(decode_batches)
                                if decode_batches else 0.0),
        "reward_failures": reward_failures,
        **{f"sd/{k}": v for k, v in rollout.speculation_summary().items() if not isinstance(v, list)},
        **{f"train/{k}": v for k, v in update.items()},
    }


def build_engine(loaded, config: TrainConfig) -> RolloutEngine:
    """The rollout engine for a run mode. Every mode shares the rest of the step, so comparisons are fair."""
    run, batch = config.run, config.rollout.max_batch_size
    check_speculation(run)  # load_config checked it already; a config built in code may not have been
    # cuda_graphs=None: the engine captures graphs when its model is on CUDA (false: never)
    precision = dict(dtype=config.rollout.dtype, cuda_graphs=None if config.rollout.cuda_graphs else False)
    if run.speculative == "off":
        return RolloutEngine(loaded, max_batch_size=batch, **precision)
    if run.drafter:
        drafter = EagleDrafter.load(run.drafter, loaded.model)
    else:  # untrained: spot training teaches it
        drafter = EagleDrafter(loaded.model.config).attach(loaded.model)
    strategy = SpecStrategy.parse(run.strategy)
    if run.speculative == "static":
        arms = [strategy]
    else:
        # Both acceptance rules compete: q-sampling wins where the drafter's q is close to p (1 - TV(p, q) per
        # token), target-only where its trees are cheaper to verify (N = 8 or 16 instead of K + (S - 1) K^2).
        arms = list(dict.fromkeys([SpecStrategy.chain(3), strategy, SpecStrategy(5, 3, 16),
                                   SpecStrategy.chain(4, "q"), SpecStrategy(3, 2, rule="q")]))
    engine = RolloutEngine(loaded, max_batch_size=batch, drafter=drafter,
                           max_tree_size=max(a.tree_size for a in arms), **precision)
    gate, arms = _gate_and_arms(engine, run, arms)
    if gate == 0:
        return engine  # speculation cannot pay on this device: plain decoding (the drafter is kept for metrics)
    if run.speculative == "static":
        engine.speculation = FixedSpeculation(strategy, gate)
    else:
        engine.speculation = AdaptiveSpeculation(arms, BatchSizeGate(threshold=gate))
    return engine


def _gate_and_arms(engine: RolloutEngine, run, arms: list) -> tuple[int, list]:
    """The configured gate, or with `run.gate=auto` the one the device's measured cost curve gives (cached per
    device, model and arms; see rollout/cost_curve.py), with the arms that can pay there."""
    if run.gate != "auto":
        return int(run.gate), arms
    curve = curve_for(engine, arms)
    engine.cost_curve = curve
    kept = [a for a in arms if a.name in curve.arms()]
    gate = curve.gate() if kept else 0
    log = logging.getLogger(__name__)
    if gate == 0:
        log.warning("run.gate=auto: on %s no speculation arm is expected to pay (a step of the cheapest costs "
                    "%.2fx a plain step at batch 1, expected tau %.1f): decoding without speculation; set run.gate "
                    "to a batch size to speculate anyway", curve.device,
                    min(curve.ratio(a.name, curve.batches[0]) for a in arms), EXPECTED_TAU)
    else:
        log.info("run.gate=auto: speculate at batch <= %d on %s with %s", gate, curve.device,
                 ", ".join(a.name for a in kept))
    return gate, kept


def _chunks(rows: list[int], size: int):
    for start in range(0, len(rows), max(1, size)):
        yield rows[start:start + size]


def _percentile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return float(sorted_values[index])
