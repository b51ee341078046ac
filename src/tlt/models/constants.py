"""Tensors a step reads but does not compute: made once, then kept for every later step."""

from __future__ import annotations

from typing import Callable

import torch


def made_once(cache: dict, key, make: Callable):
    """cache[key], made by make() the first time. Not kept when made inside a CUDA graph capture (memory the
    graph's pool owns: a graph's warm-up run makes it first, so the captured step reads it as a constant) or
    under torch.compile."""
    value = cache.get(key)
    if value is None:
        value = make()
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not (capturing or torch.compiler.is_compiling()):
            cache[key] = value
    return value
