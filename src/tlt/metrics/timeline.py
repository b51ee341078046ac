"""What each worker did during an RL step, as intervals on one wall clock.

Workers are separate processes on one machine (or threads in-process), so they stamp intervals with
`time.time()`; the controller shifts them to seconds after the step began. The kinds:
  rollout      plain decode/prefill steps          rollout_sd   speculative decode steps
  logprobs     scoring for the update: rewards, reference log-probs (KL), and old log-probs with several
               updates per step (fed to the drafter's feature buffer as well); with one update, none
  spot_train   drafter training on an otherwise idle worker
  idle         waiting for the slowest worker      update       gradient, all-reduce and optimizer step
Beside them, overlays: work that runs at the same time as the intervals, on a thread of its own —
  tail_train   drafter training beside a lone worker's rollout tail (drafter/tail_trainer.py)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from tlt.files import write_whole
from tlt.metrics.figures import draw_timeline

KINDS = ("rollout", "rollout_sd", "logprobs", "spot_train", "idle", "update")
OVERLAY_KINDS = ("tail_train",)


@dataclass
class Interval:
    kind: str
    start: float  # time.time() while recording; seconds after the step start once normalized
    end: float


@dataclass
class WorkerTimeline:
    """One worker's intervals in one step."""

    worker: int
    intervals: list[Interval] = field(default_factory=list)
    overlays: list[Interval] = field(default_factory=list)

    def record(self, kind: str, start: float, end: float | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown timeline kind {kind!r}; expected one of {KINDS}")
        self.intervals.append(Interval(kind, start, time.time() if end is None else end))

    def record_overlay(self, kind: str, start: float, end: float) -> None:
        if kind not in OVERLAY_KINDS:
            raise ValueError(f"unknown overlay kind {kind!r}; expected one of {OVERLAY_KINDS}")
        self.overlays.append(Interval(kind, start, end))

    def add_rollout(self, rollout, wall_start: float, wall_end: float | None = None) -> None:
        """Turn an engine trace into intervals: runs of consecutive plain / SD steps become one interval each.
        The rollout is busy from `wall_start` to `wall_end` (its return, a tail trainer stopped): the host work
        between steps (admission, a drafter hot-swap, the tail trainer's start and stop) belongs to the interval
        before it, never to idle."""
        first = len(self.intervals)
        for step in rollout.steps:
            kind = "rollout_sd" if step.mode == "sd" else "rollout"
            start, end = wall_start + step.start_s, wall_start + step.start_s + step.wall_s
            last = self.intervals[-1] if len(self.intervals) > first else None
            if last is not None and last.kind == kind:
                last.end = end
            else:
                if last is not None:
                    last.end = start
                self.intervals.append(Interval(kind, start if last is not None else wall_start, end))
        if wall_end is not None and len(self.intervals) > first:
            self.intervals[-1].end = max(self.intervals[-1].end, wall_end)


def merge_step(step: int, timelines: list[WorkerTimeline], step_start: float, step_end: float) -> dict:
    """All workers' intervals relative to the step start, with idle gaps made explicit."""
    workers = []
    for timeline in sorted(timelines, key=lambda t: t.worker):
        intervals = sorted(timeline.intervals, key=lambda i: i.start)
        filled, cursor = [], step_start
        for interval in intervals:
            if interval.start - cursor > 1e-3:
                filled.append(Interval("idle", cursor, interval.start))
            filled.append(interval)
            cursor = max(cursor, interval.end)
        if step_end - cursor > 1e-3:
            filled.append(Interval("idle", cursor, step_end))
        workers.append({"worker": timeline.worker, "intervals": _relative(filled, step_start),
                        "overlays": _relative(timeline.overlays, step_start)})
    return {"step": step, "duration": round(step_end - step_start, 4), "workers": workers}


def _relative(intervals: list[Interval], step_start: float) -> list[dict]:
    return [{"kind": i.kind, "start": round(i.start - step_start, 4), "end": round(i.end - step_start, 4)}
            for i in intervals]


def time_shares(timeline: dict) -> dict:
    """Fraction of all worker-seconds spent in each kind (overlays: seconds they ran, beside the intervals)."""
    totals = {kind: 0.0 for kind in KINDS + OVERLAY_KINDS}
    for worker in timeline["workers"]:
        for interval in worker["intervals"] + worker.get("overlays", []):
            totals[interval["kind"]] += interval["end"] - interval["start"]
    whole = timeline["duration"] * max(1, len(timeline["workers"]))
    return {kind: value / whole if whole > 0 else 0.0 for kind, value in totals.items()}


def drop_timelines_after(run_dir: Path, step: int) -> None:
    """A resumed run's steps past its checkpoint are run again: the crashed run's pictures of them go (a step the
    resumed run does not reach again, e.g. with fewer run.steps, would otherwise show the other run's)."""
    for path in sorted((Path(run_dir) / "timeline").glob("step_*.*")):
        number = path.stem[len("step_"):]
        if number.isdigit() and int(number) > step:
            path.unlink()


def save_timeline(run_dir: Path, timeline: dict, *, draw: bool = True) -> Path:
    """timeline/step_NNNN.json, plus the Gantt chart beside it when matplotlib is installed."""
    directory = Path(run_dir) / "timeline"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{timeline['step']:04d}.json"
    text = json.dumps(timeline)
    write_whole(path, lambda staged: staged.write_text(text))
    if draw:
        try:
            draw_timeline(timeline, path.with_suffix(".png"))
        except ImportError:  # MissingExtraError: matplotlib is an optional extra; the JSON is the record
            pass
    return path
