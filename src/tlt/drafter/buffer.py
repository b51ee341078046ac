"""FeatureBuffer: the drafter's training data, kept across RL steps.

Each entry is one sample's token ids and the target's final normed hidden states f_t at the same positions,
tagged with the RL step that produced it. Training pairs are aligned as (x_{t+1}, f_t) -> f_{t+1}: the drafter
sees the feature at t and the token that followed, and must predict the feature at t+1.

Unlike the reference implementation, which wiped its buffer every RL step, this buffer persists: it is bounded
by a token budget, evicts the oldest entries first, and samples biased toward recent steps (the policy drifts,
so recent features matter more, but older ones still teach the drafter the language of the task).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch

from tlt.errors import TltError


class BufferError(TltError):
    """Features that do not fit the buffer."""


@dataclass(frozen=True)
class FeatureEntry:
    tokens: torch.Tensor    # [T] long, x_0 .. x_{T-1}
    features: torch.Tensor  # [T, H] float, f_0 .. f_{T-1} (f_t is the hidden state at the position of x_t)
    step: int               # RL step that produced it

    @property
    def num_pairs(self) -> int:
        return self.tokens.shape[0] - 1


@dataclass
class PackedPairs:
    """Training pairs packed into [R, L] rows, documents kept apart by a block-diagonal causal mask."""

    input_tokens: torch.Tensor    # [R, L] x_{t+1}
    input_features: torch.Tensor  # [R, L, H] f_t
    target_features: torch.Tensor  # [R, L, H] f_{t+1}
    positions: torch.Tensor       # [R, L] position within its document
    attention_mask: torch.Tensor  # [R, L, L] bool: same document and causal
    valid: torch.Tensor           # [R, L] bool: a real pair (False = padding)


def pad_rows(batch: PackedPairs, rows: int) -> PackedPairs:
    """`batch` with padding rows added up to `rows` (no pair; each position attends to itself, as a packed
    row's padding does)."""
    extra = rows - batch.valid.shape[0]
    if extra <= 0:
        return batch
    length = batch.valid.shape[1]

    def more(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat((tensor, tensor.new_zeros(extra, *tensor.shape[1:])))
    eye = torch.eye(length, dtype=torch.bool).expand(extra, -1, -1)
    return PackedPairs(more(batch.input_tokens), more(batch.input_features), more(batch.target_features),
                       more(batch.positions), torch.cat((batch.attention_mask, eye)), more(batch.valid))


class FeatureBuffer:
    """Bounded by `max_tokens`; `recency` in [0, 1) sets how strongly sampling favors recent RL steps
    (weight of an entry = (1 - recency) ** age_in_steps; 0 = uniform)."""

    def __init__(self, max_tokens: int, *, recency: float = 0.3, seed: int = 0, holdout_every: int = 0,
                 holdout_entries: int = 16, holdout_first: int = 4):
        """holdout_every = N > 0: the first `holdout_first` entries and every N-th one after them go to `held`
        instead (the newest `holdout_entries` kept, outside the token budget), never sampled for training: what a
        trained version is judged on (drafter/gate.py), from the first publish of a run on."""
        if max_tokens < 2:
            raise BufferError(f"max_tokens must be >= 2, got {max_tokens}")
        if not 0 <= recency < 1:
            raise BufferError(f"recency must be in [0, 1), got {recency}")
        self.max_tokens = max_tokens
        self.recency = recency
        self.entries: deque[FeatureEntry] = deque()
        self.tokens = 0
        self.hidden_size: int | None = None
        self._rng = random.Random(seed)
        self.holdout_every = holdout_every
        self.held: deque[FeatureEntry] = deque(maxlen=holdout_entries)
        self.holdout_first = holdout_first
        self._added = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, tokens: torch.Tensor, features: torch.Tensor, step: int) -> None:
        """Store one sample (tokens [T], features [T, H]); evicts the oldest entries past the budget."""
        if tokens.dim() != 1 or features.dim() != 2 or tokens.shape[0] != features.shape[0]:
            raise BufferError(f"expected tokens [T] and features [T, H], got {tuple(tokens.shape)} and "
                              f"{tuple(features.shape)}")
        if self.hidden_size is not None and features.shape[1] != self.hidden_size:
            raise BufferError(f"features have hidden size {features.shape[1]}, the buffer holds {self.hidden_size}")
        if tokens.shape[0] < 2:
            return  # no pair to learn from
        if tokens.shape[0] > self.max_tokens:
            raise BufferError(f"one sample of {tokens.shape[0]} tokens exceeds the buffer budget of "
                              f"{self.max_tokens} tokens")
        self.hidden_size = features.shape[1]
        # copies, never views: a view of a micro-batch's hidden states kept the whole [B, L, H] tensor alive
        # (the token budget then bounded nothing) and changed with the caller's tensor
        entry = FeatureEntry(tokens.detach().to("cpu", torch.long, copy=True),
                             features.detach().to("cpu", torch.float32, copy=True), step)
        self._added += 1
        if self.holdout_every > 0 and (self._added <= self.holdout_first or self._added % self.holdout_every == 0):
            self.held.append(entry)
            return
        self.entries.append(entry)
        self.tokens += tokens.shape[0]
        while self.tokens > self.max_tokens:
            self.tokens -= self.entries.popleft().tokens.shape[0]

    def add_samples(self, tokens: torch.Tensor, hidden: torch.Tensor, starts: list[int], ends: list[int],
                    step: int) -> None:
        """Add rows of an actor pass (tokens [B, L], hidden [B, L, H], right padded): row b's positions
        [starts[b], ends[b]) — the response plus the last prompt token, whose feature drafts the first
        response token."""
        for row, (start, end) in enumerate(zip(starts, ends)):
            self.add(tokens[row, start:end], hidden[row, start:end], step)

    def take(self) -> list[FeatureEntry]:
        """Remove and return every entry (a worker hands its step's features on and starts empty)."""
        entries = list(self.entries)
        self.entries.clear()
        self.tokens = 0
        return entries

    def steps(self) -> list[int]:
        return sorted({entry.step for entry in self.entries})

    def sample(self, count: int) -> list[FeatureEntry]:
        """`count` entries drawn with replacement, weighted toward recent RL steps."""
        if not self.entries:
            raise BufferError("the feature buffer is empty")
        newest = max(entry.step for entry in self.entries)
        weights = [(1 - self.recency) ** (newest - entry.step) for entry in self.entries]
        return self._rng.choices(list(self.entries), weights=weights, k=count)

    def split_holdout(self, fraction: float) -> tuple[list[FeatureEntry], list[FeatureEntry]]:
        """Newest-first holdout: the most recent `fraction` of entries (what the drafter will face next)."""
        entries = list(self.entries)
        held = max(1, int(len(entries) * fraction)) if entries else 0
        return entries[:len(entries) - held], entries[len(entries) - held:]


def pack_pairs(entries: list[FeatureEntry], row_length: int) -> PackedPairs:
    """Greedy first-fit packing of entries' aligned pairs into rows of `row_length` pairs.

    An entry longer than a row is split into row-sized pieces (each piece keeps its own causal context only:
    the drafter attends within a piece).
    """
    if row_length < 1:
        raise BufferError(f"row_length must be >= 1, got {row_length}")
    pieces = []
    for entry in entries:
        for start in range(0, entry.num_pairs, row_length):
            stop = min(entry.num_pairs, start + row_length)
            pieces.append((entry, start, stop))
    rows: list[list[tuple]] = []
    room: list[int] = []
    for piece in sorted(pieces, key=lambda p: p[2] - p[1], reverse=True):
        size = piece[2] - piece[1]
        slot = next((i for i, free in enumerate(room) if free >= size), None)
        if slot is None:
            rows.append([])
            room.append(row_length)
            slot = len(rows) - 1
        rows[slot].append(piece)
        room[slot] -= size
    return _materialize(rows, row_length, entries[0].features.shape[1] if entries else 0)


def _materialize(rows, row_length: int, hidden: int) -> PackedPairs:
    count = len(rows)
    tokens = torch.zeros(count, row_length, dtype=torch.long)
    inputs = torch.zeros(count, row_length, hidden)
    targets = torch.zeros(count, row_length, hidden)
    positions = torch.zeros(count, row_length, dtype=torch.long)
    document = torch.full((count, row_length), -1, dtype=torch.long)
    for r, pieces in enumerate(rows):
        cursor = 0
        for doc, (entry, start, stop) in enumerate(pieces):
            size = stop - start
            span = slice(cursor, cursor + size)
            tokens[r, span] = entry.tokens[start + 1:stop + 1]        # x_{t+1}
            inputs[r, span] = entry.features[start:stop]              # f_t
            targets[r, span] = entry.features[start + 1:stop + 1]     # f_{t+1}
            positions[r, span] = torch.arange(size)
            document[r, span] = doc
            cursor += size
    valid = document >= 0
    same_doc = (document[:, :, None] == document[:, None, :]) & valid[:, :, None]
    causal = torch.tril(torch.ones(row_length, row_length, dtype=torch.bool))
    # Padding rows attend to themselves only, so attention never sees an empty row (NaN-free softmax).
    mask = (same_doc & causal) | torch.eye(row_length, dtype=torch.bool)
    return PackedPairs(tokens, inputs, targets, positions, mask, valid)
