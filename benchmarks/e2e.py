"""End to end: RL step time of TRL's GRPOTrainer, tlt without SD (the baseline) and tlt in full TLT mode.

Same model (SmolLM2-135M-Instruct, fp32), task (built-in arithmetic, chat template), reward, seeds, batch (4
prompts x 4 samples), 256 new tokens at T=1, optimizer and step count. tlt runs 2 Ray workers x 1 thread; TRL
runs one process with 2 threads (same cores). The two tlt modes run interleaved, one step each in turn.

    python benchmarks/e2e.py --drafter DIR --json benchmarks/results/e2e.json [--steps K] [--seeds 0 1] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402
from rl_pairs import interleaved_runs  # noqa: E402

CURVE_KEYS = ("reward_mean", "accuracy", "response_len_mean", "step_s", "rollout_s", "train_s",
              "rollout_tail_share", "idle_fraction", "spot_train_share", "sd/tau", "sd/sd_step_share")


def tlt_modes(drafter: str, seed: int, max_new_tokens: int) -> dict[str, list[str]]:
    common = ["run.workers=2", "run.backend=ray", "run.threads_per_worker=1", f"run.seed={seed}",
              f"rollout.max_new_tokens={max_new_tokens}", "run.tensorboard=false"]
    return {"baseline": common + ["run.speculative=off"],
            "tlt": common + ["run.speculative=adaptive", f"run.drafter={drafter}", "run.spot_training=true"]}


def run_trl(seed: int, steps: int, max_new_tokens: int) -> list[dict]:
    import torch

    from tlt.models.default_model import default_model_dir
    from tlt.rl.config import TrainConfig
    from tlt.rl.rewards import build_reward
    from tlt.tasks import ArithmeticTask, ArithmeticTaskConfig
    from trl_baseline import trl_step_times

    torch.set_num_threads(2)
    config = TrainConfig()
    task = ArithmeticTask(ArithmeticTaskConfig(min_operations=config.task.min_operations,
                                               max_operations=config.task.max_operations))
    # exactly the prompts tlt draws: step k uses seed run.seed * 1_000_003 + k
    examples = [task.sample(config.rollout.prompts_per_step, seed=seed * 1_000_003 + k) for k in range(steps)]
    return trl_step_times(str(default_model_dir()), examples, build_reward(config.task),
                          samples_per_prompt=config.rollout.samples_per_prompt, max_new_tokens=max_new_tokens,
                          seed=seed)


def curves(history: list[dict]) -> dict:
    return {key: [round(float(m.get(key, 0.0)), 4) for m in history] for key in CURVE_KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--quick", action="store_true", help="1 step, 128 new tokens, no TRL")
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args()
    steps, tokens = (1, 128) if args.quick else (args.steps, 256)
    result = {"environment": environment(), "steps": steps, "max_new_tokens": tokens, "seeds": args.seeds,
              "runs": {}}
    for seed in args.seeds:
        history = interleaved_runs(tlt_modes(args.drafter, seed, tokens), steps)
        result["runs"][f"seed{seed}"] = {name: curves(runs) for name, runs in history.items()}
    import ray

    ray.shutdown()  # free the workers' memory before TRL loads its own copy
    if not (args.quick or args.skip_trl):
        trl = run_trl(args.seeds[0], steps, tokens)
        result["runs"][f"seed{args.seeds[0]}"]["trl"] = {"step_s": [round(t["step_s"], 2) for t in trl],
                                                         "reward_mean": [t.get("reward_mean") for t in trl]}
    summarize(result)
    write_json(args.json, result)
    print({k: v for k, v in result.items() if k not in ("runs", "environment")})


def summarize(result: dict) -> None:
    """Medians over all steps of all seeds; ratios of medians."""
    runs = result["runs"].values()

    def pooled(mode: str, key: str) -> list[float]:
        return [v for run in runs if mode in run for v in run[mode][key]]

    baseline, tlt = statistics.median(pooled("baseline", "step_s")), statistics.median(pooled("tlt", "step_s"))
    shares = [r / s for r, s in zip(pooled("baseline", "rollout_s"), pooled("baseline", "step_s"))]
    result.update({"baseline_step_s": round(baseline, 2), "tlt_step_s": round(tlt, 2),
                   "speedup_vs_baseline": round(baseline / tlt, 3),
                   "rollout_share_baseline": round(statistics.median(shares), 3),
                   "rollout_tail_share_baseline": round(statistics.median(pooled("baseline", "rollout_tail_share")), 3),
                   "baseline_rollout_s": round(statistics.median(pooled("baseline", "rollout_s")), 2),
                   "tlt_rollout_s": round(statistics.median(pooled("tlt", "rollout_s")), 2)})
    trl = pooled("trl", "step_s")
    if trl:
        result["trl_step_s"] = round(statistics.median(trl), 2)
        result["speedup_vs_trl"] = round(statistics.median(trl) / tlt, 3)


if __name__ == "__main__":
    main()
