"""Figures for docs/benchmarks.md, drawn from the benchmark JSON files.

    python benchmarks/plots.py   # writes every figure whose JSON exists in benchmarks/results/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tau_over_steps(data: dict, path: Path) -> None:
    """Spot-trained vs frozen drafter: τ per RL step (T=1) and spot-training steps per RL step."""
    plt = _pyplot()
    tau = data["tau"]["tau"]
    steps = range(1, len(tau["spot"]) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    left.plot(steps, tau["spot"], "o-", label="spot-trained, hot-swapped")
    left.plot(steps, tau["frozen"], "s--", label="frozen warm-up drafter")
    left.set(xlabel="RL step", ylabel="τ (tokens per verify step)", title="drafter adaptation, T=1")
    left.legend()
    right.bar(steps, data["tau"]["spot_train_steps"])
    right.set(xlabel="RL step", ylabel="drafter optimizer steps", title="spot training per RL step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def e2e_curves(data: dict, path: Path) -> None:
    """Reward, accuracy, response length and step time per RL step: baseline vs TLT, every seed."""
    plt = _pyplot()
    keys = ("reward_mean", "accuracy", "response_len_mean", "step_s")
    fig, axes = plt.subplots(1, len(keys), figsize=(15, 3.4))
    for run_name, run in data["runs"].items():
        for mode, style in (("baseline", "-o"), ("tlt", "--s")):
            if mode not in run:
                continue
            for axis, key in zip(axes, keys):
                values = run[mode][key]
                axis.plot(range(1, len(values) + 1), values, style, label=f"{mode} {run_name}")
        if "trl" in run:
            values = run["trl"]["step_s"]
            axes[-1].plot(range(1, len(values) + 1), values, ":^", label=f"TRL {run_name}")
    for axis, key in zip(axes, keys):
        axis.set(title=key, xlabel="RL step")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    for name, draw in (("spot_training", tau_over_steps), ("e2e", e2e_curves)):
        source = RESULTS / f"{name}.json"
        if source.exists():
            draw(json.loads(source.read_text()), source.with_suffix(".png"))
            print(f"wrote {source.with_suffix('.png')}")


if __name__ == "__main__":
    main()
