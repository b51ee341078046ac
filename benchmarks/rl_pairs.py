"""Run several `tlt train` configurations side by side, one RL step of each in turn.

Interleaving steps (A1 B1 A2 B2 ...) rather than running A then B puts both modes under the same machine
conditions, so their step-time ratios survive the drift of a noisy VM. Each mode keeps its own Ray workers alive
for the whole run; only one mode computes at a time.
"""

from __future__ import annotations

import statistics
import time

from tlt.distributed.backends import threads_per_worker
from tlt.distributed.controller import DistributedGRPO
from tlt.distributed.placement import resolve
from tlt.rl.config import load_config


def interleaved_runs(modes: dict[str, list[str]], steps: int, *, log=print, replay_from: str | None = None,
                     on_step=None, warmup_steps: int = 0) -> dict[str, list[dict]]:
    """modes: name -> `section.key=value` overrides. Returns name -> per-step metrics (with the timeline and
    each sample's response length). on_step(history), if given, is called after every mode's step with the
    history so far (e.g. to write partial results that survive a kill).

    warmup_steps: RL steps every mode runs first, logged but not returned. On CUDA a mode's first steps capture
    its graphs (one per batch bucket and KV block, and in TLT mode per speculation arm too: many more than the
    baseline's) and measure its cost curve: one-off seconds that are not the step time of a run.

    replay_from: equal work. That mode runs first in every step, naturally, and its samples' lengths are
    recorded; every other mode replays them (each sample decodes exactly its recorded length, stop tokens
    ignored: rollout/replay.py), which is checked sample by sample."""
    configs = {name: load_config(None, overrides) for name, overrides in modes.items()}
    if replay_from is not None:  # the reference runs first in every step
        configs = {replay_from: configs[replay_from], **{k: v for k, v in configs.items() if k != replay_from}}
    _start_ray_if_needed(configs)
    controllers = {}
    try:
        for name, config in configs.items():
            started = time.perf_counter()
            controllers[name] = DistributedGRPO(config)
            log(f"{name}: {controllers[name].placement.describe()}, up in {time.perf_counter() - started:.1f}s")
        history: dict[str, list[dict]] = {name: [] for name in configs}
        for step in range(-warmup_steps, steps):
            label = f"step {step + 1}" if step >= 0 else f"warm-up step {step + warmup_steps + 1}"
            recorded = None
            for name, controller in controllers.items():
                replay = replay_from is not None and name != replay_from
                metrics = controller.train_step(lengths=recorded if replay else None)
                metrics["timeline"] = controller.last_timeline
                metrics["response_lengths"] = [len(s.token_ids) for s in controller.last_rollout.samples]
                if name == replay_from:
                    recorded = metrics["response_lengths"]
                elif replay and metrics["response_lengths"] != recorded:
                    raise AssertionError(f"{name} {label} decoded other lengths than {replay_from}: "
                                         f"{metrics['response_lengths']} vs {recorded}")
                if step >= 0:
                    history[name].append(metrics)
                    if on_step is not None:
                        on_step(history)
                log(f"{name} {label}: {metrics['step_s']:.1f}s (rollout {metrics['rollout_s']:.1f}s, "
                    f"{sum(metrics['response_lengths'])} tokens) tau {metrics.get('sd/tau', 0):.2f} "
                    f"spot {metrics['spot_train_steps']} reward {metrics['reward_mean']:.3f}")
        return history
    finally:
        for controller in controllers.values():
            controller.close()


def _start_ray_if_needed(configs: dict) -> None:
    """Every mode's workers stay resident, one mode computing at a time: Ray gets logical CPUs for all of them."""
    placed = [resolve(config)[0] for config in configs.values()]
    if not any(config.run.backend == "ray" for config in placed):
        return
    import ray

    if not ray.is_initialized():
        threads = sum(threads_per_worker(config) * config.run.workers for config in placed)
        ray.init(num_cpus=2 * threads, include_dashboard=False, logging_level="ERROR")


def median(history: list[dict], key: str, skip_first: bool = False) -> float:
    values = [m[key] for m in (history[1:] if skip_first and len(history) > 1 else history)]
    return statistics.median(values)
