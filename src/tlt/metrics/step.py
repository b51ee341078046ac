"""One RL step's metrics, as the step line, metrics.jsonl and the loggers report them.

Pure functions over what a step produced (its RolloutResult, rewards, the update's statistics, the engine's
speculation policy, the workers' decode traces), so both drivers — GRPOTrainer in-process and the distributed
controller — compute the same keys the same way. `tlt report` and `--resume` read these keys back from
metrics.jsonl: renaming one breaks older run directories.
"""

from __future__ import annotations

import dataclasses
import statistics

from tlt.rollout.policy import ArmStats
from tlt.rollout.request import tail_rows

ARM_PREFIX = "sd/arm/"  # sd/arm/<arm>/<count or rate>


def step_metrics(rollout, rewards, correct, update: dict, rollout_s: float, train_s: float,
                 reward_failures: int) -> dict:
    """What a step's metrics line and metrics.jsonl report: learning, lengths, time, the long tail, SD.
    `rollout`: a RolloutResult; `rewards` [N] and `correct` [N]: tensors; `update`: the update's statistics."""
    lengths = sorted(len(s.token_ids) for s in rollout.samples)
    decode_batches = rollout.batch_size_trace()
    summary = rollout.speculation_summary()
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
        "tail_steps_fraction": _tail_steps_fraction(decode_batches),
        "reward_failures": reward_failures,
        # τ is left out of a step without SD steps: a mean of nothing, which a curve drawn at 0 would misread
        **{f"sd/{k}": v for k, v in summary.items() if isinstance(v, (int, float))},
        **{f"sd/acceptance_d{depth}": share for depth, share in enumerate(summary["acceptance_by_depth"], 1)},
        **{f"train/{k}": v for k, v in update.items()},
    }


def speculation_metrics(engine) -> dict:
    """The gate the device's cost curve chose (run.gate=auto), and τ and tokens/s per arm of the engine's
    speculation policy (cumulative over the run: the policy carries across steps)."""
    metrics = {}
    curve = engine.cost_curve
    if curve is not None:
        metrics["sd/gate"] = curve.gate()
        metrics.update({f"sd/cost_ratio_b1/{arm}": curve.ratio(arm, curve.batches[0]) for arm in curve.step_s})
    policy = engine.speculation
    arms = policy.summary().get("arms", {}) if policy is not None else {}
    return {**metrics, **{f"{ARM_PREFIX}{name}/{key}": value for name, stats in arms.items()
                          for key, value in stats.items()}}


def _tail_steps_fraction(decode_batches: list[int]) -> float:
    """Share of decode steps in the long tail (the peak taken once: it was taken again for every step)."""
    if not decode_batches:
        return 0.0
    tail = tail_rows(max(decode_batches))
    return sum(b <= tail for b in decode_batches) / len(decode_batches)


def merge_speculation_metrics(parts: list[dict]) -> dict:
    """Data-parallel workers' `speculation_metrics` as the run's: each worker's bandit learns on its own rows,
    so per-arm counts add up and τ and tokens/s follow from the sums (one worker's alone left the others' arm
    use out, and switched worker between steps). The gate and cost ratios are the device's: the first's."""
    merged = {key: value for key, value in parts[0].items() if not key.startswith(ARM_PREFIX)} if parts else {}
    counts: dict[str, ArmStats] = {}
    count_fields = {item.name for item in dataclasses.fields(ArmStats)}
    for part in parts:
        for key, value in part.items():
            if key.startswith(ARM_PREFIX):
                name, item = key[len(ARM_PREFIX):].rsplit("/", 1)
                if item in count_fields:
                    stats = counts.setdefault(name, ArmStats())
                    setattr(stats, item, getattr(stats, item) + value)
    merged.update({f"{ARM_PREFIX}{name}/{key}": value for name, stats in counts.items()
                   for key, value in stats.metrics().items()})
    return merged


def tail_time_share(worker_traces: list[tuple[float, list]]) -> float:
    """Share of the rollout's decoding time (from the first decode step's start to the last one's end, all
    workers: prompt prefills before the first decode step are not in it) during which the rows still decoding,
    summed over workers, are at most `tail_rows` of that sum's peak: the long tail.
    `worker_traces`: per worker, (wall-clock start of its rollout, its StepTraces)."""
    events = []  # (wall time, worker, rows running from then on)
    for worker, (start, steps) in enumerate(worker_traces):
        events += [(start + s.start_s, worker, s.batch_size) for s in steps if s.kind == "decode"]
        if steps:
            last = steps[-1]
            events.append((start + last.start_s + last.wall_s, worker, 0))
    if not events:
        return 0.0
    events.sort()
    running, peak, tail, previous = {}, 0, 0.0, events[0][0]
    for when, worker, rows in events:
        total = sum(running.values())
        if running and 0 < total <= tail_rows(peak):
            tail += when - previous
        previous = when
        running[worker] = rows
        peak = max(peak, sum(running.values()))
    span = events[-1][0] - events[0][0]
    return tail / span if span > 0 else 0.0


def _percentile(sorted_values: list[int], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default): p50 is the median. (Rounding the rank
    with Python's round, half to even, put p50 of [10, 20] at 10 and of [10, 20, 30, 40] at 30.)"""
    if not sorted_values:
        return 0.0
    rank = q / 100 * (len(sorted_values) - 1)
    low = min(int(rank), len(sorted_values) - 1)
    high = min(low + 1, len(sorted_values) - 1)
    return float(sorted_values[low] + (rank - low) * (sorted_values[high] - sorted_values[low]))
