"""`tlt report RUN_DIR`: one self-contained HTML page (PNG figures beside it) for a training run directory.

Every metric is optional: runs written by older versions lack keys, and a figure or column whose keys are
missing is skipped rather than failing the whole report. matplotlib is the optional extra `bench`.
"""

from __future__ import annotations

import html
import json
import math
import os
import shutil
from pathlib import Path

from tlt.errors import TltError

KIND_COLORS = {"rollout": "#4c72b0", "rollout_sd": "#55a868", "logprobs": "#8172b2", "spot_train": "#dd8452",
               "idle": "#d0d0d0", "update": "#c44e52", "tail_train": "#dd8452"}
TAU_KEYS = ("sd/tau", "sd/mean_accepted", "drafter/tau")  # newest name first; older runs used the others
# (header, metric key, format) of the step table; a column appears when any step has its key
STEP_COLUMNS = [("step", "step", "{:d}"), ("reward", "reward_mean", "{:.3f}"), ("accuracy", "accuracy", "{:.3f}"),
                ("held-out acc", "eval_accuracy", "{:.3f}"),
                ("len p50", "response_len_p50", "{:.0f}"), ("len p90", "response_len_p90", "{:.0f}"),
                ("len max", "response_len_max", "{:.0f}"), ("rollout s", "rollout_s", "{:.2f}"),
                ("train s", "train_s", "{:.2f}"), ("tok/s", "rollout_tok_s", "{:.1f}")]
IDLE_COLUMN = ("idle", "idle_fraction", "{:.1%}")
WORKER_COLUMNS = [("step s", "step_s", "{:.1f}"), ("spot-train", "spot_train_share", "{:.1%}"),
                  ("spot steps", "spot_train_steps", "{:d}"), ("drafter v", "drafter_version", "{:d}")]
CSS = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:0.5em 0}"
       "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}th{background:#f3f3f3}"
       "td.k{text-align:left}img{max-width:100%;display:block;margin:0.5em 0}")


class MissingExtraError(TltError, ImportError):
    """matplotlib is not installed. Also an ImportError, so callers that treat drawing as optional can skip it."""


def write_report(run_dir, out=None) -> Path:
    """Write `index.html` and its PNGs to `out` (default RUN_DIR/report) and return the HTML path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise TltError(f"{run_dir}: no such run directory")
    from tlt.metrics.logger import read_metrics

    metrics = read_metrics(run_dir)
    if not metrics:
        raise TltError(f"{run_dir / 'metrics.jsonl'}: missing or empty; is {run_dir} a `tlt train` run directory?")
    out = Path(out) if out is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    curves = _draw_curves(metrics, out)
    timelines = _timeline_section(run_dir, out)
    sections = [_config_section(run_dir), "<h2>Steps</h2>" + _step_table(metrics),
                "<h2>Curves</h2>" + "".join(_img(name, title) for title, name in curves),
                timelines, _sd_section(metrics[-1])]
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(run_dir.name)}</title>"
            f"<style>{CSS}</style></head><body><h1>Run {_e(run_dir.resolve().name)}</h1>"
            f"<p>{_e(str(run_dir))}, {len(metrics)} step(s)</p>{''.join(sections)}</body></html>\n")
    path = out / "index.html"
    path.write_text(page)
    return path


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


# -- figures ----------------------------------------------------------------------------------------------------


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
    points = [(m.get("step", i + 1), m[key]) for i, m in enumerate(metrics) if _number(m.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def _draw_curves(metrics: list[dict], out: Path) -> list[tuple[str, str]]:
    """The run's curves as (title, file name); a figure with none of its keys present is skipped."""
    tau = [key for key in TAU_KEYS if _series(metrics, key)[0]]
    figures = [("reward and accuracy", "curves_reward.png", [("reward_mean", "reward"), ("accuracy", "accuracy"),
                                                             ("eval_accuracy", "held-out accuracy (greedy)")]),
               ("response length", "curves_length.png", [("response_len_p50", "p50"), ("response_len_p90", "p90"),
                                                         ("response_len_max", "max")]),
               ("speculative decoding τ", "curves_tau.png", [(key, key) for key in tau])]
    drawn = [(title, name) for title, name, series in figures if _line_plot(metrics, out / name, title, series)]
    if _time_plot(metrics, out / "curves_time.png"):
        drawn.insert(2, ("step time split", "curves_time.png"))
    return drawn


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
    rows = [m for m in metrics if _number(m.get("rollout_s")) and _number(m.get("train_s"))]
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


def _timeline_section(run_dir: Path, out: Path) -> str:
    """The latest step's Gantt chart (drawn unless training already drew it) and links to the other steps."""
    files = sorted((run_dir / "timeline").glob("step_*.json"))
    if not files:
        return ""
    latest = files[-1]
    image = out / f"timeline_{latest.stem}.png"
    drawn = latest.with_suffix(".png")
    if drawn.exists():
        shutil.copyfile(drawn, image)
    else:
        draw_timeline(json.loads(latest.read_text()), image)
    links = [f"<a href='{_e(_relative(f.with_suffix('.png') if f.with_suffix('.png').exists() else f, out))}'>"
             f"{_e(f.stem)}</a>" for f in files[:-1]]
    other = f"<p>Other steps: {', '.join(links)}</p>" if links else ""
    return f"<h2>Worker timeline</h2>{_img(image.name, f'timeline, {latest.stem}')}{other}"


# -- HTML -------------------------------------------------------------------------------------------------------


def _config_section(run_dir: Path) -> str:
    """config.json as one key/value table per section (model, task, rollout, grpo, optim, run)."""
    path = run_dir / "config.json"
    if not path.exists():
        return "<h2>Config</h2><p>no config.json</p>"
    config = json.loads(path.read_text())
    parts = ["<h2>Config</h2>"]
    for section, values in config.items():
        rows = values.items() if isinstance(values, dict) else [(section, values)]
        parts.append(f"<h3>{_e(section)}</h3>" + _table(["key", "value"], [[k, _fmt(v)] for k, v in rows], keyed=True))
    return "".join(parts)


def _step_table(metrics: list[dict]) -> str:
    tau = next((key for key in TAU_KEYS if any(key in m for m in metrics)), None)
    candidates = STEP_COLUMNS + ([("τ", tau, "{:.2f}")] if tau else []) + [IDLE_COLUMN] + WORKER_COLUMNS
    columns = [c for c in candidates if any(c[1] in m for m in metrics)]
    rows = [[_fmt(m.get(key), spec) for _, key, spec in columns] for m in metrics]
    return _table([header for header, _, _ in columns], rows)


def _sd_section(latest: dict) -> str:
    """The latest step's speculative-decoding statistics (sd/* and drafter/*)."""
    keys = sorted(k for k in latest if k.startswith(("sd/", "drafter/")) or k == "drafter_versions")
    if not keys:
        return ""
    rows = [[key, _fmt(latest[key])] for key in keys]
    title = f"<h2>Speculative decoding, step {_e(str(latest.get('step', '?')))}</h2>"
    return title + _table(["metric", "value"], rows, keyed=True)


def _table(headers: list[str], rows: list[list], *, keyed: bool = False) -> str:
    """An HTML table of already formatted cells; `keyed` left-aligns the first column (names, not numbers)."""
    head = "".join(f"<th>{_e(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td{' class=k' if keyed and i == 0 else ''}>{_e(str(c))}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(name: str, title: str) -> str:
    return f"<figure><img src='{_e(name)}' alt='{_e(title)}'><figcaption>{_e(title)}</figcaption></figure>"


def _fmt(value, spec: str = "{:.4g}") -> str:
    """A cell's text: numbers with the column's format, anything else (None, lists, strings) as JSON-ish text."""
    if value is None:
        return "–"
    if _number(value):
        try:
            return spec.format(value)
        except ValueError:  # e.g. "{:d}" given a float
            return f"{value:.4g}"
    return value if isinstance(value, str) else json.dumps(value)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _relative(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path, start)).as_posix()


def _e(text: str) -> str:
    return html.escape(text, quote=True)
