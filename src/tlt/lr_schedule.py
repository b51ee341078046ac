"""The learning-rate multiplier of a step: linear warm-up, then constant or cosine to a floor. Below both the RL
optimizer (rl/optim.py) and the drafter's warm-up (drafter/warmup.py), which share it."""

from __future__ import annotations

import math


def lr_factor(step: int, *, schedule: str, warmup_steps: int, horizon: int, min_lr_ratio: float) -> float:
    """The multiplier of the base lr at step `step` (0-based): linear warm-up, then constant or cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, horizon - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
