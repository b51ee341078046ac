"""Metrics kept as 0-d device tensors while a loop runs, read to the host at once at its end: on a GPU each
float() of a tensor is a sync (the update phase, the drafter's trainer beside a decoding thread)."""

from __future__ import annotations

import torch


def metrics_to_host(parts: list[dict]) -> list[dict]:
    """Each dict's 0-d tensor (or float) values as floats, all read in one device-to-host copy."""
    keys = [(index, key) for index, part in enumerate(parts) for key in part]
    tensors = [value for part in parts for value in part.values() if isinstance(value, torch.Tensor)]
    host = [{} for _ in parts]
    if tensors:
        values = torch.stack([value.detach().reshape(()).to(torch.float64) for value in tensors]).tolist()
        read = iter(values)
    for index, key in keys:
        value = parts[index][key]
        host[index][key] = next(read) if isinstance(value, torch.Tensor) else float(value)
    return host
