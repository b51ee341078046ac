"""The CPU default's worker layout on equal work: 2 Ray workers x 1 thread vs 1 worker x 2 threads, SD off.

`tlt train` on the CPU defaulted to 2 workers (the layout in which a worker idle in the tail spot-trains the
drafter) until this benchmark moved it to 1 (docs/benchmarks.md section 12). This times the rest of the step under
each layout: the same prompts, every sample decoding exactly the length a reference run of the default layout gave
it (stop tokens ignored: rollout/replay.py), one step of each mode in turn, medians over steps. Speculation is off
in every mode, so only the layout differs.

    python benchmarks/worker_layout.py --json benchmarks/results/worker_layout.json [--steps 3]
    python benchmarks/worker_layout.py --speculative --json benchmarks/results/worker_layout_tlt.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402
from rl_pairs import interleaved_runs  # noqa: E402

KEYS = ("step_s", "rollout_s", "train_s")


def modes(out: str, speculative: bool = False) -> dict[str, list[str]]:
    """SD off in every mode; `speculative`: the two layouts in TLT mode instead (adaptive SD, a drafter from
    scratch trained by the idle worker with 2 workers, beside the tail with 1), the reference staying SD off."""
    common = ["run.tensorboard=false", "run.checkpoint_every=0"]
    mode = ["run.speculative=adaptive"] if speculative else ["run.speculative=off"]
    return {"reference": [*common, "run.speculative=off", "run.workers=2", f"run.out_dir={out}/reference"],
            "two_workers": [*common, *mode, "run.workers=2", f"run.out_dir={out}/two_workers"],
            "one_worker": [*common, *mode, "run.workers=1", f"run.out_dir={out}/one_worker"]
            + (["run.tail_training=on"] if speculative else [])}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--out", default="/tmp/tlt-worker-layout")
    parser.add_argument("--speculative", action="store_true", help="both layouts in TLT mode (drafter from scratch)")
    args = parser.parse_args(argv)
    result = {"environment": environment(), "steps": args.steps, "equal_work": True,
              "speculative": args.speculative, "complete": False}

    def partial(history):
        result["by_mode"] = summarize(history)
        write_json(args.json, result, echo=False)

    history = interleaved_runs(modes(args.out, args.speculative), args.steps, replay_from="reference", on_step=partial,
                               warmup_steps=args.warmup_steps)
    result["by_mode"] = summarize(history)
    two, one = result["by_mode"]["two_workers"], result["by_mode"]["one_worker"]
    result.update({f"{key}_ratio_two_over_one": two[key] / one[key] for key in KEYS})
    result["complete"] = True
    write_json(args.json, result)
    return result


def summarize(history: dict) -> dict:
    return {name: {**{key: statistics.median(m[key] for m in steps) for key in KEYS},
                   "response_tokens": [sum(m["response_lengths"]) for m in steps],
                   "tau": [m.get("sd/tau") for m in steps], "sd_step_share": [m.get("sd/sd_step_share") for m in steps],
                   "drafter_steps": [m["spot_train_steps"] for m in steps]}
            for name, steps in history.items() if steps}


if __name__ == "__main__":
    main()
