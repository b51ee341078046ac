"""The record every task yields: a prompt, the reference answer, and free-form metadata."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskExample:
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False)


RECORD_UNITS = ("line", "row", "record")  # how dataset loaders number an example's record (TaskExample.meta)


def record_label(example) -> str | None:
    """Where an example comes from ("data/x.jsonl, line 6"), for the engine's errors about its request (the
    engine would say "requests[0]", which tells a training user nothing); None for generated examples."""
    meta = getattr(example, "meta", None) or {}
    if "source" not in meta:
        return None
    return ", ".join([str(meta["source"]), *(f"{unit} {meta[unit]}" for unit in RECORD_UNITS if unit in meta)])
