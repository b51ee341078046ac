"""The phases of one GRPO step, as functions over explicit inputs: a PolicyReplica, the step, the data.

  sample_prompts → rollout → score (rewards → group advantages → packed samples → the log-probs the update
  needs) → [collect_features: an idle worker's drafter features, early] → update (PPO-clip over micro-batches)

Both drivers call exactly these: GRPOTrainer (rl/trainer.py) in one process, and each RolloutWorker of the
distributed controller (distributed/worker.py) on its shard; they only sequence them. With one optimizer update
per step (the default) the old log-probs equal the update's own, so no separate old-log-prob forward runs: the
ratio is exp(logp - logp.detach()) (value 1, the policy gradient), as in TRL. With several updates per step the
old log-probs are recomputed by the actor (no grad) before the first one. Either way they are the training
forward's: where the rollout decodes with other numerics (a bf16 copy on CUDA), its own log-probs differ a little,
and `grpo.rollout_is` weights each token by min(pi_old / pi_rollout, cap) (truncated importance sampling; the
mismatch is logged as rollout_kl whenever the rollout's log-probs are of the trained softmax).

Every random choice derives from (run seed, step, a prompt's position in the step), so with speculation off a
resumed run repeats exactly what an uninterrupted one would have done (with it on, samples follow the same
distribution: docs/architecture.md).

Drafter features come from a forward the step runs anyway: the old-log-prob pass when there is one, else the
update's own forward, or earlier a decoder-only pass of a worker idle in others' tail (`collect_features`). A
batch scored with a FeatureBuffer carries it, with how many micro-batches are already in it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass

import torch

from tlt.device_values import metrics_to_host
from tlt.drafter.buffer import FeatureBuffer
from tlt.rl.actor import PackedSamples, actor_hidden, token_logprobs
from tlt.rl.config import TrainConfig
from tlt.rl.config_checks import filtered_sampling
from tlt.rl.grpo import group_advantages, policy_loss
from tlt.rl.optim import advance_schedule, training_autocast
from tlt.rl.replica import PolicyReplica
from tlt.rl.update_memory import warn_if_it_may_not_fit
from tlt.rollout.replay import length_matched, regroup
from tlt.rollout.request import Request, RolloutResult
from tlt.sampling import SamplingParams
from tlt.tasks import DatasetTask
from tlt.tasks.example import record_label

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """Everything one RL step learns from, flattened sample-major (prompt p's samples are rows p*n .. p*n+n-1)."""

    step: int                    # the RL step it belongs to: its lr, and the step its drafter features are from
    packed: PackedSamples
    rewards: torch.Tensor        # [N]
    correct: torch.Tensor        # [N] bool
    reward_failures: int         # samples whose reward function raised (scored 0)
    advantages: torch.Tensor     # [N]
    old_logprobs: torch.Tensor | None  # [N, L - 1]; None: on-policy, the update's own log-probs (detached)
    ref_logprobs: torch.Tensor | None
    # [N, L - 1] the rollout's own log-probs of the sampled tokens, laid out as old_logprobs; None when they are of
    # another distribution than the update's (top-k/top-p sampling)
    rollout_logprobs: torch.Tensor | None = None
    is_cap: float | None = None  # truncated importance weights min(pi_old / pi_rollout, is_cap); None: unweighted
    # Where this batch's drafter features go, and how many micro-batches (in update order) are in it already; the
    # update's forward adds the rest. features_done None: nothing to collect (no buffer, or the old-log-prob pass
    # did it).
    features: FeatureBuffer | None = None
    features_done: int | None = None


def step_seed(config: TrainConfig, step: int) -> int:
    return config.run.seed * 1_000_003 + step


def sample_prompts(replica: PolicyReplica, step: int) -> list:
    """The step's prompts, from the run seed and the step (every replica would draw the same): a dataset is read
    in shuffled epochs, a generated task draws new problems."""
    count, task = replica.config.rollout.prompts_per_step, replica.task
    source = getattr(task, "source", None)  # a ChatTask's examples; a task given to the trainer samples itself
    if isinstance(source, DatasetTask):
        return source.step_examples(count, step, replica.config.run.seed)
    return task.sample(count, seed=step_seed(replica.config, step))


def rollout(replica: PolicyReplica, examples: list, step: int, *, progress: bool = False, between_steps=None,
            lengths: list[int] | None = None, collect_features=None, first: int = 0) -> RolloutResult:
    """`samples_per_prompt` samples of every example. `lengths` (one per sample, prompt-major): an equal-work
    replay, every sample decodes exactly its length with stop tokens ignored (rollout/replay.py; benchmarks
    only). `progress`, `between_steps` and `collect_features`: see `RolloutEngine.generate`. `first`: the first
    example's position among the step's prompts (a worker's shard): each prompt's samples draw the random
    stream of its position in the step, whatever the sharding (workers drew the same streams for their k-th
    prompts: a prompt on two workers got identical samples, and run.workers changed the run)."""
    cfg = replica.config.rollout
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            max_new_tokens=cfg.max_new_tokens, seed=step_seed(replica.config, step))
    requests = [Request(replica.task.prompt_ids(example), n=cfg.samples_per_prompt, params=params,
                        label=record_label(example), stream=first + index)
                for index, example in enumerate(examples)]
    replica.model.eval()
    engine = replica.engine
    if engine.speculation is not None:
        engine.speculation.reset()  # the batch restarts large: the gate closes again
    hooks = {"progress": progress, "between_steps": between_steps, "collect_features": collect_features}
    if lengths is None:
        return engine.generate(requests, **hooks)
    return regroup(engine.generate(length_matched(requests, lengths), **hooks), requests)


def score(replica: PolicyReplica, examples: list, rollout: RolloutResult, step: int,
          features: FeatureBuffer | None = None) -> StepBatch:
    """Rewards → group-normalized advantages → packed samples, and the log-probs the update needs besides its
    own: the reference's (KL), and the sampling policy's with several updates per step. `features`: where the
    drafter's features of this batch go (None: nowhere)."""
    config, tokenizer = replica.config, replica.tokenizer
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in rollout.samples]
    scored = replica.reward.score(texts, [examples[s.request_index] for s in rollout.samples])
    rewards = torch.tensor(scored.rewards, dtype=torch.float32)
    if config.grpo.overlong_buffer > 0:
        rewards = rewards - overlong_penalties([len(s.token_ids) for s in rollout.samples], config)
    n = config.rollout.samples_per_prompt
    advantages = group_advantages(rewards.view(-1, n), scale_rewards=config.grpo.scale_rewards).view(-1)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    packed = PackedSamples.build([list(s.prompt_ids) for s in rollout.samples],
                                 [s.token_ids for s in rollout.samples], pad, replica.device)
    # Several updates per step move the policy between them: the ratio then needs the log-probs of the policy
    # that sampled. With one update they would equal the update's own, so that forward is skipped.
    old = None
    if config.grpo.updates_per_step > 1:
        old = no_grad_logprobs(replica, replica.model, packed, step, features)
    ref = no_grad_logprobs(replica, replica.reference, packed, step) if replica.reference is not None else None
    pending = 0 if features is not None and old is None else None
    sampled = None if filtered_sampling(config.rollout) else rollout_logprobs(rollout, packed)
    if config.grpo.mask_truncated:
        packed.mask_responses([row for row, s in enumerate(rollout.samples) if s.finish_reason == "length"])
    return StepBatch(step, packed, rewards, torch.tensor(scored.correct), scored.failures,
                     advantages.to(replica.device), old, ref, sampled, importance_cap(replica),
                     features=features, features_done=pending)


def overlong_penalties(lengths: list[int], config: TrainConfig) -> torch.Tensor:
    """DAPO's soft overlong punishment per response: 0 up to max_new_tokens - overlong_buffer tokens, then rising
    linearly to overlong_penalty at the budget (a response cut there gets all of it): long rambling loses reward
    before the hard cut, which alone rewards a cut response like a finished one."""
    budget, buffer = config.rollout.max_new_tokens, config.grpo.overlong_buffer
    into = (torch.tensor(lengths, dtype=torch.float32) - (budget - buffer)).clamp(0, buffer)
    return config.grpo.overlong_penalty * into / buffer


def rollout_logprobs(rollout: RolloutResult, packed: PackedSamples) -> torch.Tensor:
    """[N, L - 1] each sampled token's log-prob as the rollout computed it, where `packed.response_mask` is set."""
    values = torch.tensor([lp for s in rollout.samples for lp in s.logprobs], dtype=torch.float32)
    out = torch.zeros(packed.response_mask.shape, dtype=torch.float32)
    out[packed.response_mask.cpu()] = values  # row-major: each row's response positions in order
    return out.to(packed.response_mask.device)


def importance_cap(replica: PolicyReplica) -> float | None:
    """The cap of the truncated importance weights this run applies (`grpo.rollout_is`), or None."""
    grpo = replica.config.grpo
    if grpo.rollout_is == "off" or filtered_sampling(replica.config.rollout):
        return None
    # "auto": only where the rollout's numerics differ from the training forward's (in fp32 on both sides the
    # weights are 1 to ~1e-6 and would only add noise)
    if grpo.rollout_is == "auto" and replica.engine.rollout_copy is None and replica.autocast_dtype is None:
        return None
    return grpo.rollout_is_cap


def no_grad_logprobs(replica: PolicyReplica, model, packed: PackedSamples, step: int,
                     features: FeatureBuffer | None = None) -> torch.Tensor:
    """Log-probs of `model` (the policy or the reference) at every response position, without a graph; the
    policy's pass also feeds `features` when given."""
    out = torch.zeros(packed.input_ids.shape[0], packed.input_ids.shape[1] - 1, device=replica.device)
    collect = features is not None and model is replica.model
    with torch.no_grad(), training_autocast(replica.autocast_dtype, replica.device):
        for chunk in micro_batches(replica.config, packed):
            micro = packed.select(chunk)
            actor = token_logprobs(model, micro, replica.config.rollout.temperature, want_hidden=collect)
            out[chunk, :actor.logprobs.shape[1]] = actor.logprobs
            if collect:
                _add_features(features, micro, actor.hidden, step)
    return out


def collect_features(replica: PolicyReplica, batch: StepBatch, should_stop=lambda: False,
                     limit: int | None = None) -> int:
    """Feed the batch's feature buffer now, micro-batch by micro-batch, with a forward of the decoder alone,
    until `should_stop()` (or `limit` more micro-batches); the update's forward collects the rest. A worker
    idle in other workers' tail calls it, so that spot training has this step's features at once. Returns the
    micro-batches collected so far."""
    if batch.features_done is None:
        return 0
    chunks = micro_batches(replica.config, batch.packed)
    end = len(chunks) if limit is None else min(len(chunks), batch.features_done + limit)
    replica.model.eval()
    with torch.no_grad(), training_autocast(replica.autocast_dtype, replica.device):  # as the other feature passes
        while batch.features_done < end and not should_stop():
            micro = batch.packed.select(chunks[batch.features_done])
            _add_features(batch.features, micro, actor_hidden(replica.model, micro), batch.step)
            batch.features_done += 1
    return batch.features_done


def micro_batches(config: TrainConfig, packed: PackedSamples) -> list[list[int]]:
    """Row indices, longest rows first, `optim.micro_batch_size` at a time or, under a token budget
    (`micro_batch_token_budget`), as many as fit it: rows of similar lengths share a micro-batch, so less of
    each forward is padding. The loss is normalized by whole-step totals, so the grouping does not change it
    (or the gradient) beyond float rounding."""
    lengths = [p + r for p, r in zip(packed.prompt_lengths, packed.response_lengths)]
    rows = sorted(range(len(lengths)), key=lambda row: -lengths[row])  # stable: ties keep their order
    budget = micro_batch_token_budget(config, packed.prompt_lengths, packed.input_ids.device.type)
    if budget is None:
        size = max(1, config.optim.micro_batch_size)
        return [rows[start:start + size] for start in range(0, len(rows), size)]
    chunks: list[list[int]] = []
    for row in rows:  # a micro-batch is padded to its first (longest) row
        if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= budget:
            chunks[-1].append(row)
        else:
            chunks.append([row])  # (a row longer than the budget goes alone)
    return chunks


def micro_batch_token_budget(config: TrainConfig, prompt_lengths: list[int], device_type: str) -> int | None:
    """The padded tokens (rows x the longest row) a micro-batch may hold, or None: `optim.micro_batch_size`
    rows. "auto" on CUDA: micro_batch_size rows at the longest length this batch's rows could have had, so no
    micro-batch takes more memory than the configured worst case, while a step of short responses runs in a
    few large micro-batches (on an H200, 16 samples' update took 0.48 s in micro-batches of 4 and 0.13 s in
    one of 16: launch-bound; update_cost_h200.json). On the CPU, compute-bound, it stays off."""
    setting = config.optim.micro_batch_tokens
    if setting == "auto":
        if device_type != "cuda" or not prompt_lengths:
            return None
        return max(1, config.optim.micro_batch_size) * (max(prompt_lengths) + config.rollout.max_new_tokens)
    return setting or None


def loss_totals(config: TrainConfig, batch: StepBatch) -> dict:
    """The loss normalizers of this batch; data-parallel workers sum theirs so every shard's loss is
    normalized by the global batch (then summed gradients equal the single-worker gradient)."""
    return {"tokens": float(batch.packed.response_mask.sum()), "sequences": float(batch.rewards.shape[0]),
            "max_tokens": float(config.rollout.max_new_tokens)}


def update(replica: PolicyReplica, batch: StepBatch, totals: dict | None = None, reduce_gradients=None) -> dict:
    """PPO-clip over micro-batches; each micro-batch's loss is weighted so the accumulated gradient equals
    the full-batch loss's gradient (micro 1 x accumulation 8 == micro 8 x accumulation 1).
    `totals`: the global batch's loss normalizers (default: this batch's). `reduce_gradients(parameters)`
    (data parallel) sums the gradients across replicas before clipping."""
    cfg, grpo, model = replica.config.optim, replica.config.grpo, replica.model
    if batch.old_logprobs is None and grpo.updates_per_step > 1:
        raise ValueError("a batch scored without old log-probs allows one update per step only")
    totals = totals or loss_totals(replica.config, batch)
    if totals["tokens"] == 0:
        # every response masked (grpo.mask_truncated; the totals are global, so every replica returns here): no
        # optimizer step, which would still move the weights by AdamW's momentum and decay
        advance_schedule(replica.scheduler, batch.step)
        return {"loss": 0.0, "tokens": 0.0}
    _warn_if_the_largest_micro_batch_may_not_fit(replica, batch.packed)
    model.train()
    parts: list[dict] = []  # each micro-batch's loss parts, every pass
    grad_norms, skipped = [], 0
    advance_schedule(replica.scheduler, batch.step)  # this step's lr (all its passes share it)
    for update_pass in range(grpo.updates_per_step):
        replica.optimizer.zero_grad(set_to_none=True)
        for index, chunk in enumerate(micro_batches(replica.config, batch.packed)):
            # the entropy of the policy that sampled: the first pass's (a metric, a few % of the head's cost)
            parts.append(_micro_batch_backward(replica, batch, index, chunk, totals, entropy=update_pass == 0))
        if reduce_gradients is not None:
            reduce_gradients([p for p in model.parameters() if p.requires_grad])
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0
                                                    else math.inf))
        if not math.isfinite(norm):
            # A NaN/inf gradient would make every weight NaN, and the checkpoint after it; every replica sees the
            # same reduced gradients, so all skip together and stay identical.
            skipped += 1
            log.warning("RL step %d: the gradient norm is %s; this update is skipped (the weights stay as they were)",
                        batch.step + 1, norm)  # (steps count from 1 wherever a user reads them)
            continue
        grad_norms.append(norm)  # also without clipping (max_norm inf): the norm is computed either way
        replica.optimizer.step()
        if batch.features_done is not None:  # every micro-batch's features are in now
            batch.features_done = None
    replica.optimizer.zero_grad(set_to_none=True)
    model.eval()
    summary = combine_loss_parts(metrics_to_host(parts), passes=grpo.updates_per_step)  # one read for all
    if grad_norms:
        summary["grad_norm"] = statistics.fmean(grad_norms)
    if skipped:
        summary["skipped_updates"] = skipped
    return summary


def _warn_if_the_largest_micro_batch_may_not_fit(replica: PolicyReplica, packed: PackedSamples) -> None:
    lengths = [p + r for p, r in zip(packed.prompt_lengths, packed.response_lengths)]
    rows, width = max(((len(chunk), max(lengths[i] for i in chunk)) for chunk in micro_batches(replica.config, packed)),
                      key=lambda shape: shape[0] * shape[1])
    dtype = replica.autocast_dtype or next(replica.model.parameters()).dtype
    warn_if_it_may_not_fit(replica.model, rows, width, element_size=dtype.itemsize,
                           checkpointed=replica.config.optim.grad_checkpointing)


def combine_loss_parts(parts: list[dict], passes: int = 1) -> dict:
    """The update's loss metrics from its micro-batches' (or, data parallel, its workers') parts: `loss` is the
    step's loss (each part is its share of it), averaged over the update passes; the per-token metrics
    (clip_fraction, ratio_mean, kl) are weighted by each part's tokens, so neither moves with micro_batch_size
    or the number of workers. `tokens`: the response tokens of one pass. A metric only some parts report (the
    entropy, of the first pass) is averaged over those."""
    tokens = sum(part["tokens"] for part in parts)
    summary = {"loss": sum(part["loss"] for part in parts) / passes, "tokens": tokens / passes}
    for key in sorted(set().union(*parts) - {"loss", "tokens"}):
        having = [part for part in parts if key in part]
        summary[key] = sum(part[key] * part["tokens"] for part in having) / max(sum(p["tokens"] for p in having), 1.0)
    return summary


def merge_worker_updates(summaries: list[dict]) -> dict:
    """Data parallel: the workers' update summaries as the step's. The loss parts combine (each worker's loss is
    its shard's share of the global loss); grad_norm and skipped_updates are of the all-reduced gradients, the
    same on every worker."""
    shared = {key: value for key, value in summaries[0].items() if key in ("grad_norm", "skipped_updates")}
    parts = [{key: value for key, value in summary.items() if key not in shared} for summary in summaries]
    return {**combine_loss_parts(parts), **shared}


def _micro_batch_backward(replica: PolicyReplica, batch: StepBatch, index: int, chunk: list[int],
                          totals: dict, entropy: bool = False) -> dict:
    """One micro-batch's forward (feeding the drafter's features it still owes) and backward; its loss parts."""
    grpo = replica.config.grpo
    micro = batch.packed.select(chunk)
    width = micro.response_mask.shape[1]
    collect = batch.features_done is not None and index >= batch.features_done
    with training_autocast(replica.autocast_dtype, replica.device):
        actor = token_logprobs(replica.model, micro, replica.config.rollout.temperature, want_hidden=collect,
                               want_entropy=entropy)
    if collect:  # the skipped old-log-prob pass would have fed the buffer: this forward does
        _add_features(batch.features, micro, actor.hidden, batch.step)
    logprobs = actor.logprobs
    old = batch.old_logprobs[chunk, :width] if batch.old_logprobs is not None else logprobs.detach()
    ref = batch.ref_logprobs[chunk, :width] if batch.ref_logprobs is not None else None
    sampled = batch.rollout_logprobs[chunk, :width] if batch.rollout_logprobs is not None else None
    loss, parts = policy_loss(grpo.loss, logprobs, old, batch.advantages[chunk], micro.response_mask, totals,
                              clip_low=grpo.clip_low, clip_high=grpo.clip_high, ref_logprobs=ref,
                              kl_coef=grpo.kl_coef, rollout_logprobs=sampled, is_cap=batch.is_cap,
                              entropy=actor.entropy, host_metrics=False, importance_level=grpo.importance_level)
    loss.backward()
    return parts


def _add_features(features: FeatureBuffer, micro: PackedSamples, hidden: torch.Tensor, step: int) -> None:
    starts, ends = micro.feature_spans()
    features.add_samples(micro.input_ids, hidden.detach(), starts, ends, step)


# -- held-out evaluation ------------------------------------------------------------------------------------------

def evaluation_due(config: TrainConfig, step: int) -> bool:
    """After step `step`: every task.eval_every steps and after the last one (with a held-out set)."""
    return step % config.task.eval_every == 0 or step == config.run.steps


def held_out_due(replica: PolicyReplica, step: int) -> bool:
    """Whether this replica evaluates after step `step`: its task has a held-out set and one is due."""
    return bool(getattr(replica.task, "eval_examples", None)) and evaluation_due(replica.config, step)


def evaluate(replica: PolicyReplica) -> dict:
    """Greedy accuracy and mean reward on the held-out examples (decoded like a rollout, without noise)."""
    started = time.perf_counter()
    examples = replica.task.eval_examples
    params = SamplingParams(temperature=0, max_new_tokens=replica.config.rollout.max_new_tokens)
    replica.model.eval()
    engine = replica.engine
    # Plain decoding: greedy SD emits the same tokens, but its observations would feed the bandit (whose
    # τ estimates are for the rollout temperature) and its numerics would depend on the drafter version.
    speculation, engine.speculation = engine.speculation, None
    try:
        result = engine.generate([Request(replica.task.prompt_ids(e), params=params, label=record_label(e))
                                  for e in examples])
    finally:
        engine.speculation = speculation
    texts = [replica.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in result.samples]
    scored = replica.reward.score(texts, [examples[s.request_index] for s in result.samples])
    return {"eval_accuracy": sum(scored.correct) / len(examples),
            "eval_reward_mean": sum(scored.rewards) / len(examples), "eval_s": time.perf_counter() - started}
