"""Step metrics: one JSON line per step in RUN_DIR/metrics.jsonl (always: `tlt report` and `--resume` read it),
plus the scalar loggers `run.logger` names: TensorBoard (when installed) and Weights & Biases (the wandb extra)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from tlt.errors import TltError
from tlt.files import write_whole
from tlt.metrics.wandb_logger import WandbLogger

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True, sinks=(), resumed_at: int | None = None):
        """sinks: objects with log(step, scalars) and close(), given each step's finite numeric metrics.
        resumed_at: the step a resumed run continues after; TensorBoard hides the events a crashed run wrote
        past it (the resumed run writes those steps again: the curves would show both)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        writer = _tensorboard_writer(Path(run_dir) / "tensorboard", resumed_at) if tensorboard else None
        self.sinks = ([_TensorBoard(writer)] if writer is not None else []) + list(sinks)

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{key: _json_value(value) for key, value in metrics.items()}}
        with self.path.open("a") as handle:
            # strict JSON (jq, JSON.parse and pandas read it): a NaN/inf metric is written as null
            handle.write(json.dumps(record, allow_nan=False) + "\n")
        scalars = scalar_metrics(metrics)
        for sink in self.sinks:
            sink.log(step, scalars)

    def truncate_after(self, step: int) -> None:
        """Drop lines past `step` (a resumed run rewrites the steps its crash lost, never duplicates them)."""
        if not self.path.exists():
            return
        kept = [(line, record) for line, record in _records(self.path) if record["step"] <= step]
        missing = sorted(set(range(1, step + 1)) - {record["step"] for _, record in kept})
        if missing:  # a last line cut short whose step did reach a checkpoint (found by QA): said, not silent
            log.warning("%s holds no record of step(s) %s, which the checkpoint holds (a line cut short?): their "
                        "metrics are lost; the run goes on from step %d", self.path, missing[:10], step)
        text = "".join(line + "\n" for line, _ in kept)
        write_whole(self.path, lambda path: path.write_text(text))  # killed midway: the history stays whole

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_metrics_logger(run_dir: Path, config, *, resumed_at: int | None = None) -> MetricsLogger:
    """The logger a `tlt train` run's config asks for (run.logger; run.tensorboard=false drops tensorboard);
    resumed_at: the checkpoint's step, when resuming."""
    names = logger_names(config.run)
    sinks = []
    if "wandb" in names:
        sinks.append(WandbLogger.start(run_dir, config, resuming=resumed_at is not None))
    return MetricsLogger(run_dir, tensorboard="tensorboard" in names, sinks=sinks, resumed_at=resumed_at)


def logger_names(run) -> set[str]:
    """run.logger, less tensorboard when run.tensorboard is false (metrics.jsonl is written either way)."""
    return set(run.logger) - (set() if run.tensorboard else {"tensorboard"})


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """What scalar loggers get: finite numbers (not flags, lists or text)."""
    return {key: value for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [record for _, record in _records(path)] if path.exists() else []


def _records(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of each step in metrics.jsonl. A last line cut short (a run killed while writing it, or
    one being written now) is left out: its step never reached a checkpoint. Any other line that is not a step
    record is a TltError naming it."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            if number == len(lines) and not text.endswith("\n"):
                break  # cut short: every line is written whole with its newline
            raise TltError(f"{path}, line {number}: not a step record (a JSON object with an integer step); "
                           f"delete or mend that line (the checkpoints do not depend on it)")
        previous = records[-1][1]["step"] if records else 0
        if record["step"] <= previous:  # a run writes steps 1, 2, ... once each (a resume truncates first)
            raise TltError(f"{path}, line {number}: step {record['step']} "
                           + (f"after step {previous}" if records else "(steps start at 1)")
                           + ": a run's steps increase; delete or mend that line (the checkpoints do not depend on it)")
        records.append((line, record))
    return records


class _TensorBoard:
    def __init__(self, writer):
        self.writer = writer

    def log(self, step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _tensorboard_writer(directory: Path, resumed_at: int | None = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is an optional extra
        return None
    # purge_step: TensorBoard drops the events of steps >= it that earlier event files hold
    return SummaryWriter(str(directory), purge_step=None if resumed_at is None else resumed_at + 1)


def _json_value(value):
    """A metric as strict JSON takes it: non-finite floats become None (null), in lists and dicts too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    return value
