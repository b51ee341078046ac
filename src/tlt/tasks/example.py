"""The record every task yields: a prompt, the reference answer, and free-form metadata."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskExample:
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False)
