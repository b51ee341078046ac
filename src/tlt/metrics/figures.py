"""The figures of a run: one step's worker timeline (a Gantt chart) and the curves over steps.

Pure drawing over plain data (a timeline dict, metrics.jsonl records): training draws each step's timeline beside
its JSON, `tlt report` draws the rest. matplotlib is the optional extra `bench`, imported only when drawing.
Every metric is optional: runs written by older versions lack keys, and a figure whose keys are missing is skipped.
"""

from __future__ import annotations

import math
from pathlib import Path

from tlt.errors import TltError

KIND_COLORS = {"rollout": "#4c72b0", "rollout_sd": "#55a868", "logprobs": "#8172b2", "spot_train": "#dd8452",
               "idle": "#d0d0d0", "update": "#c44e52", "tail_train": "#dd8452"}
TAU_KEYS = ("sd/tau", "sd/mean_accepted", "drafter/tau")  # newest name first; older runs used the others


class MissingExtraError(TltError, ImportError):
    """matplotlib is not installed. Also an ImportError, so callers that treat drawing as optional can skip it."""


def draw_timeline(timeline: dict, path) -> Path:
    """One step's worker Gantt chart: a lane per worker, a color per interval kind, so idle tails stand out."""
    plt = _pyplot()
    workers = timeline.get("workers", [])
    fig, ax = plt.subplots(figsize=(10, 0.6 * max(1, len(workers)) + 1.6), layout="constrained")
    seen = set()
    for lane, worker in enumerate(workers):
        for interval in worker.get("intervals", []):
            kind = interval["kind"]
            ax.barh(lane, interval["end"] - interval["start"], left=interval["start"], height=0.6,
                    color=KIND_COLORS.get(kind, "#937860"), label=None if kind in seen else kind)
            seen.add(kind)
        for interval in worker.get("overlays", []):  # beside the intervals, on a thread of its own: a thin bar
            kind = interval["kind"]
            ax.barh(lane + 0.38, interval["end"] - interval["start"], left=interval["start"], height=0.14,
                    color=KIND_COLORS.get(kind, "#937860"), hatch="//", label=None if kind in seen else kind)
            seen.add(kind)
    ax.set_yticks(range(len(workers)), [f"worker {w.get('worker', i)}" for i, w in enumerate(workers)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since step start")
    ax.set_title(f"step {timeline.get('step', '?')}")
    if seen:
        fig.legend(loc="outside lower center", ncol=len(seen), frameon=False)
    return _save(fig, Path(path))


def draw_curves(metrics: list[dict], out: Path) -> list[tuple[str, str]]:
    """The run's curves, written to `out`, as (title, file name); a figure with none of its keys is skipped."""
    tau = [key for key in TAU_KEYS if _series(metrics, key)[0]]
    figures = [("reward and accuracy", "curves_reward.png", [("reward_mean", "reward"), ("accuracy", "accuracy"),
                                                             ("eval_accuracy", "held-out accuracy (greedy)")]),
               ("response length", "curves_length.png", [("response_len_p50", "p50"), ("response_len_p90", "p90"),
                                                         ("response_len_max", "max")]),
               ("speculative decoding τ", "curves_tau.png", [(key, key) for key in tau]),
               # the RL health curves: an entropy collapse, and how far the rollout samples from the trained policy
               ("policy entropy (nats per token)", "curves_entropy.png", [("train/entropy", "entropy")]),
               ("rollout vs training policy", "curves_mismatch.png", [("train/rollout_kl", "KL(rollout || training)")])]
    drawn = [(title, name) for title, name, series in figures if _line_plot(metrics, out / name, title, series)]
    if _time_plot(metrics, out / "curves_time.png"):
        drawn.insert(2, ("step time split", "curves_time.png"))
    return drawn


def is_number(value) -> bool:
    """A finite int or float (not a bool): what a curve or a numeric table cell can show."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pyplot():
    """matplotlib with the file-only Agg backend (reports are written on headless training machines)."""
    try:
        import matplotlib
    except ImportError as error:
        raise MissingExtraError("drawing reports and timelines needs matplotlib: pip install tlt-rl[bench]") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path


def _series(metrics: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) for the steps where `key` is a finite number."""
    points = [(m.get("step", i + 1), m[key]) for i, m in enumerate(metrics) if is_number(m.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def _line_plot(metrics: list[dict], path: Path, title: str, series: list[tuple[str, str]]) -> bool:
    present = [(label, *_series(metrics, key)) for key, label in series]
    present = [(label, steps, values) for label, steps, values in present if steps]
    if not present:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    for label, steps, values in present:
        ax.plot(steps, values, marker="o", markersize=3, label=label)
    _step_axis(ax)
    ax.set_title(title)
    ax.legend()
    _save(fig, path)
    return True


def _time_plot(metrics: list[dict], path: Path) -> bool:
    """Stacked rollout / train seconds per step: where the wall clock goes (rollout's long tail dominates)."""
    rows = [m for m in metrics if is_number(m.get("rollout_s")) and is_number(m.get("train_s"))]
    if not rows:
        return False
    plt = _pyplot()
    steps = [m.get("step", i + 1) for i, m in enumerate(rows)]
    rollout, train = [m["rollout_s"] for m in rows], [m["train_s"] for m in rows]
    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    ax.bar(steps, rollout, label="rollout", color=KIND_COLORS["rollout"])
    ax.bar(steps, train, bottom=rollout, label="train", color=KIND_COLORS["update"])
    _step_axis(ax)
    ax.set_ylabel("seconds")
    ax.set_title("step time split")
    ax.legend()
    _save(fig, path)
    return True


def _step_axis(ax) -> None:
    """Steps are integers: no 1.5 ticks on short runs."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
