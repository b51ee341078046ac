"""Spot training on vs off on SmolLM2-135M-Instruct, 2 Ray workers x 1 thread, same starting drafter, static SD
(S4K2N8 once a worker's batch is at most 8 — always, with 8 rows per worker).

Two measurements, each with the two modes' steps interleaved (benchmarks/rl_pairs.py):
  overhead  greedy decoding: SD is lossless, so both modes emit the same tokens and do the same rollout and
            update work; the step-time ratio is what spot training costs (or saves) — target <= 1.03x.
  tau       sampling at T=1 (the RL setting): tau per RL step with the spot-trained drafter vs the frozen one.

    python benchmarks/spot_training.py --drafter DIR --json benchmarks/results/spot_training.json [--steps K]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402
from rl_pairs import interleaved_runs, median  # noqa: E402


def modes(drafter: str, temperature: float, seed: int) -> dict[str, list[str]]:
    # static: one fixed strategy at batch <= 8, so tau compares drafters, not the bandit's arm choices
    common = [f"run.drafter={drafter}", "run.speculative=static", "run.strategy=S4K2N8", "run.gate=8", "run.workers=2", "run.backend=ray",
              "run.threads_per_worker=1", f"rollout.temperature={temperature}", f"run.seed={seed}",
              "run.tensorboard=false", "optim.micro_batch_size=2"]  # 2: four resident workers fit in 24 GB
    return {"spot": common + ["run.spot_training=true"], "frozen": common + ["run.spot_training=false"]}


def summarize(history: dict) -> dict:
    spot, frozen = history["spot"], history["frozen"]
    ratios = [s["step_s"] / f["step_s"] for s, f in zip(spot, frozen)]
    return {
        "step_s": {name: [round(m["step_s"], 2) for m in runs] for name, runs in history.items()},
        "rollout_s": {name: [round(m["rollout_s"], 2) for m in runs] for name, runs in history.items()},
        "tau": {name: [round(m.get("sd/tau", 0.0), 3) for m in runs] for name, runs in history.items()},
        "response_tokens": {name: [round(m["response_len_mean"] * 16) for m in runs]
                            for name, runs in history.items()},
        "spot_train_steps": [m["spot_train_steps"] for m in spot],
        "spot_train_share": [round(m["spot_train_share"], 4) for m in spot],
        "idle_fraction": {name: [round(m["idle_fraction"], 4) for m in runs] for name, runs in history.items()},
        "drafter_version": [m["drafter_version"] for m in spot],
        "samples_hot_swapped": [m["samples_hot_swapped"] for m in spot],
        "step_ratio_per_step": [round(r, 4) for r in ratios],
        "overhead_ratio_median": round(statistics.median(ratios), 4),
        "median_step_s": {name: round(median(runs, "step_s"), 2) for name, runs in history.items()},
        "timelines_spot": [m["timeline"] for m in spot],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tau-steps", type=int, default=4)
    parser.add_argument("--phases", nargs="+", choices=["overhead", "tau"], default=["overhead", "tau"],
                        help="run only these; the other phase's results already in --json are kept")
    args = parser.parse_args()
    path = Path(args.json)
    result = json.loads(path.read_text()) if path.exists() else {}
    result.update({"environment": environment(), "workers": 2, "threads_per_worker": 1, "drafter": args.drafter})
    if "overhead" in args.phases:
        print("== overhead (greedy: identical work in both modes)")
        result["overhead"] = summarize(interleaved_runs(modes(args.drafter, 0.0, 0), args.steps))
        result["spot_overhead_ratio"] = result["overhead"]["overhead_ratio_median"]
    if "tau" in args.phases:
        print("== tau over RL steps (T=1)")
        result["tau"] = summarize(interleaved_runs(modes(args.drafter, 1.0, 0), args.tau_steps))
    write_json(args.json, result)
    print(f"overhead ratio (median of per-step spot/frozen): {result.get('spot_overhead_ratio')}")
    if "tau" in result:
        print(f"tau spot {result['tau']['tau']['spot']}  frozen {result['tau']['tau']['frozen']}")


if __name__ == "__main__":
    main()
