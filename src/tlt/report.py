"""`tlt report RUN_DIR`: one self-contained HTML page (PNG figures beside it) for a training run directory.

Every metric is optional: runs written by older versions lack keys, and a figure or column whose keys are
missing is skipped rather than failing the whole report. The figures are drawn by metrics/figures.py (matplotlib,
the optional extra `bench`); this module lays out the page.
"""

from __future__ import annotations

import html
import json
import os
import shutil
from pathlib import Path

from tlt.errors import TltError, first_line
from tlt.metrics.figures import TAU_KEYS, draw_curves, draw_timeline, is_number
from tlt.metrics.logger import read_metrics
from tlt.rl.run_dir import REPLACED_DIR, has_tlt_config

# (header, metric key, format) of the step table; a column appears when any step has its key
STEP_COLUMNS = [("step", "step", "{:d}"), ("reward", "reward_mean", "{:.3f}"), ("accuracy", "accuracy", "{:.3f}"),
                ("held-out acc", "eval_accuracy", "{:.3f}"),
                ("len p50", "response_len_p50", "{:.0f}"), ("len p90", "response_len_p90", "{:.0f}"),
                ("len max", "response_len_max", "{:.0f}"), ("rollout s", "rollout_s", "{:.2f}"),
                ("train s", "train_s", "{:.2f}"), ("tok/s", "rollout_tok_s", "{:.1f}"),
                ("lr", "lr", "{:.3g}"),  # a schedule mistake (e.g. a resumed step at lr 0) shows here
                ("entropy", "train/entropy", "{:.3f}"), ("grad norm", "train/grad_norm", "{:.3g}"),
                ("rollout KL", "train/rollout_kl", "{:.2e}")]
IDLE_COLUMN = ("idle", "idle_fraction", "{:.1%}")
WORKER_COLUMNS = [("step s", "step_s", "{:.1f}"), ("spot-train", "spot_train_share", "{:.1%}"),
                  ("tail-train", "tail_train_share", "{:.1%}"),  # a lone worker's (one GPU: the default)
                  ("spot steps", "spot_train_steps", "{:d}"), ("drafter v", "drafter_version", "{:d}")]
CSS = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:0.5em 0}"
       "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}th{background:#f3f3f3}"
       "td.k{text-align:left}img{max-width:100%;display:block;margin:0.5em 0}")


GENERATOR = "<meta name='generator' content='tlt report'>"  # marks a page this module may replace


def _refuse_a_foreign_page(path: Path) -> None:
    """--out DIR holding someone else's index.html (a site, another tool's report) would lose it."""
    try:
        page = path.read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return
    if GENERATOR not in page:
        raise TltError(f"--out {path.parent} already holds an index.html that tlt report did not write: choose "
                       f"another --out (or delete it)")


# What a directory holding a model, a drafter, a checkpoint or a run has: a report's PNGs do not belong there
NOT_A_REPORT_DIR = ("config.json", "state.json", "metrics.jsonl", "drafter_config.json")


def _refuse_a_model_or_run(out: Path) -> None:
    """--out RUN/final wrote the page and its PNGs among the final policy's files (found by a CLI trial), where
    `tlt drafter export` refuses the like."""
    held = [name for name in NOT_A_REPORT_DIR if (out / name).is_file()] + [p.name for p in out.glob("*.safetensors")]
    if held:
        raise TltError(f"--out {out} holds a model, checkpoint or run ({', '.join(held[:3])}): the report would be "
                       f"mixed into it; choose another --out (default: RUN_DIR/report)")


def write_report(run_dir, out=None) -> Path:
    """Write `index.html` and its PNGs to `out` (default RUN_DIR/report) and return the HTML path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise TltError(f"{run_dir}: {'a file, not a run directory' if run_dir.exists() else 'no such run directory'}")
    if (run_dir / "metrics.jsonl").is_dir():
        raise TltError(f"{run_dir / 'metrics.jsonl'} is a directory, not a run's metrics file")
    metrics = read_metrics(run_dir)
    if not metrics and (run_dir / REPLACED_DIR).is_dir():
        raise TltError(f"{run_dir}: an --overwrite run was killed before its first checkpoint; the run it was "
                       f"replacing is intact in {run_dir / REPLACED_DIR}, and the next `tlt train` on {run_dir} puts "
                       f"it back (`tlt train run.out_dir={run_dir} --resume` goes on with it)")
    if not metrics:
        file = run_dir / "metrics.jsonl"
        what = "holds no step record" if file.is_file() and file.stat().st_size else "missing or empty"
        if has_tlt_config(run_dir):  # a run's config.json (a model's directory has one of its own)
            raise TltError(f"{file}: {what}: the run in {run_dir} has not finished its first step yet (or ended "
                           f"before it); report it once a step is logged")
        raise TltError(f"{file}: {what}; is {run_dir} a `tlt train` run directory?")
    if out is not None:  # RUN_DIR/report is tlt's own (a page there from before the marker is replaced too)
        _refuse_a_foreign_page(Path(out) / "index.html")
        _refuse_a_model_or_run(Path(out))
    out = Path(out) if out is not None else run_dir / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise TltError(f"--out {out}: it, or a directory above it, is a file") from None
    except OSError as error:  # a read-only mount, no permission
        raise TltError(f"--out {out}: cannot create it ({error.strerror})") from None
    curves = draw_curves(metrics, out)
    timelines = _timeline_section(run_dir, out)
    sections = [_config_section(run_dir), "<h2>Steps</h2>" + _step_table(metrics),
                "<h2>Curves</h2>" + "".join(_img(name, title) for title, name in curves),
                timelines, _sd_section(_latest_speculating(metrics))]
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'>{GENERATOR}<title>{_e(run_dir.name)}</title>"
            f"<style>{CSS}</style></head><body><h1>Run {_e(run_dir.resolve().name)}</h1>"
            f"<p>{_e(str(run_dir))}, {len(metrics)} step(s)</p>{''.join(sections)}</body></html>\n")
    path = out / "index.html"
    path.write_text(page, encoding="utf-8", errors="surrogateescape")  # a directory name that is not UTF-8
    return path


def _timeline_section(run_dir: Path, out: Path) -> str:
    """The latest step's Gantt chart (drawn unless training already drew it) and links to the other steps."""
    files = sorted((run_dir / "timeline").glob("step_*.json"))
    if not files:
        return ""
    latest = files[-1]
    image = out / f"timeline_{latest.stem}.png"
    drawn = latest.with_suffix(".png")
    timeline = None if drawn.exists() else _json_object(latest)
    if drawn.exists():
        shutil.copyfile(drawn, image)
        figure = _img(image.name, f"timeline, {latest.stem}")
    elif timeline is not None:
        try:
            draw_timeline(timeline, image)
            figure = _img(image.name, f"timeline, {latest.stem}")
        except (KeyError, TypeError, AttributeError, ValueError) as error:  # another tlt's, or a hand-made file
            figure = f"<p>{_e(str(latest))} is not a timeline this tlt can draw ({_e(first_line(error))})</p>"
    else:
        figure = f"<p>{_e(str(latest))} is not readable (cut short?): no chart</p>"
    links = [f"<a href='{_e(_relative(f.with_suffix('.png') if f.with_suffix('.png').exists() else f, out))}'>"
             f"{_e(f.stem)}</a>" for f in files[:-1]]
    other = f"<p>Other steps: {', '.join(links)}</p>" if links else ""
    return f"<h2>Worker timeline</h2>{figure}{other}"


def _json_object(path: Path) -> dict | None:
    """A JSON object file tlt wrote, or None when it is not one (a run killed while writing it)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# -- HTML -------------------------------------------------------------------------------------------------------


def _config_section(run_dir: Path) -> str:
    """config.json as one key/value table per section (model, task, rollout, grpo, optim, run)."""
    path = run_dir / "config.json"
    if not path.exists():
        return "<h2>Config</h2><p>no config.json</p>"
    config = _json_object(path)
    if config is None:
        return f"<h2>Config</h2><p>{_e(str(path))} is not a JSON object (cut short?)</p>"
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


def _speculated(step: dict) -> bool:
    return bool(step.get("sd/sd_step_share")) or any(k.startswith(("sd/arm/", "sd/gate", "drafter/")) for k in step)


def _latest_speculating(metrics: list[dict]) -> dict:
    """The latest step that speculated (a last step whose batch never drained to the gate ran none), else the
    latest step: the section said "no speculative step ran" beside a table of earlier steps' τ (found by review)."""
    return next((step for step in reversed(metrics) if _speculated(step)), metrics[-1])


def _sd_section(latest: dict) -> str:
    """The latest step's speculative-decoding statistics (sd/* and drafter/*)."""
    keys = sorted(k for k in latest if k.startswith(("sd/", "drafter/")) or k == "drafter_versions")
    if not keys:
        return ""
    title = f"<h2>Speculative decoding, step {_e(str(latest.get('step', '?')))}</h2>"
    if not _speculated(latest):
        return title + "<p>no speculative step ran (run.speculative=off, or the batch never drained to the gate)</p>"
    rows = [[key, _fmt(latest[key])] for key in keys]
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
    if is_number(value):
        if spec == "{:.4g}" and isinstance(value, int):
            return str(value)  # 200000, not 2e+05
        try:
            return spec.format(value)
        except ValueError:  # e.g. "{:d}" given a float
            return f"{value:.4g}"
    return value if isinstance(value, str) else json.dumps(value)


def _relative(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path, start)).as_posix()


def _e(text: str) -> str:
    return html.escape(text, quote=True)
