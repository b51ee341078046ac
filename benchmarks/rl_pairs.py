"""Run several `tlt train` configurations side by side, one RL step of each in turn.

Interleaving steps (A1 B1 A2 B2 ...) rather than running A then B puts both modes under the same machine
conditions, so their step-time ratios survive the drift of a noisy VM. Each mode keeps its own Ray workers alive
for the whole run; only one mode computes at a time.
"""

from __future__ import annotations

import statistics
import time

from tlt.distributed.controller import DistributedGRPO
from tlt.rl.config import load_config


def interleaved_runs(modes: dict[str, list[str]], steps: int, *, log=print) -> dict[str, list[dict]]:
    """modes: name -> `section.key=value` overrides. Returns name -> per-step metrics (with the timeline)."""
    import ray

    if not ray.is_initialized():  # every mode's workers stay resident; logical CPUs, one mode runs at a time
        ray.init(num_cpus=2 * len(modes) * 2, include_dashboard=False, logging_level="ERROR")
    controllers = {}
    try:
        for name, overrides in modes.items():
            started = time.perf_counter()
            controllers[name] = DistributedGRPO(load_config(None, overrides))
            log(f"{name}: workers up in {time.perf_counter() - started:.1f}s")
        history: dict[str, list[dict]] = {name: [] for name in modes}
        for step in range(steps):
            for name, controller in controllers.items():
                metrics = controller.train_step()
                metrics["timeline"] = controller.last_timeline
                history[name].append(metrics)
                log(f"{name} step {step + 1}: {metrics['step_s']:.1f}s (rollout {metrics['rollout_s']:.1f}s) "
                    f"tau {metrics.get('sd/tau', 0):.2f} spot {metrics['spot_train_steps']} "
                    f"reward {metrics['reward_mean']:.3f}")
        return history
    finally:
        for controller in controllers.values():
            controller.close()


def median(history: list[dict], key: str, skip_first: bool = False) -> float:
    values = [m[key] for m in (history[1:] if skip_first and len(history) > 1 else history)]
    return statistics.median(values)
