"""Collecting the drafter's features: the target's final normed hidden states over prompt + response."""

from __future__ import annotations

import torch

from tlt.drafter.buffer import FeatureBuffer
from tlt.models.kv_cache import KVCache
from tlt.models.lean_forward import LeanForward


@torch.no_grad()
def collect_features(target: LeanForward, prompts: list[list[int]], responses: list[list[int]],
                     buffer: FeatureBuffer, step: int, *, batch_size: int = 8) -> int:
    """One lean forward per batch of sequences; stores the response plus the last prompt token (whose feature
    drafts the first response token). Returns the number of pairs added."""
    added = 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        sequences = [list(prompts[i]) + list(responses[i]) for i in chunk]
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, :len(sequence)] = torch.tensor(sequence)
        cache = KVCache(target.spec, len(chunk), width, device=target.device, dtype=target.dtype)
        hidden = target(ids.to(target.device), cache.rows(0, len(chunk)), logits_at=None).hidden
        starts = [len(prompts[i]) - 1 for i in chunk]
        ends = [len(s) for s in sequences]
        buffer.add_samples(ids, hidden, starts, ends, step)
        added += sum(e - s - 1 for s, e in zip(starts, ends))
    return added
