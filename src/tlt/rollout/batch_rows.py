"""What a step needs from the host about its rows, kept while the batch's rows stay the same.

A decode step's host work used to grow with the batch: one generator call per row for its uniforms (~4 µs a
row on these hosts: ~0.3 ms a step at batch 64, more than a captured step's launch) and the per-row sampling
settings rebuilt as four new tensors. Between admissions and retirements the running rows do not change, so
`BatchRows` keeps, for the current rows:

- the sampling settings (`RowSampling`, host tensors: the same objects step after step, which lets the graph
  runner skip copying them again);
- a block of each row's next uniforms (4 steps' worth after the rows change, doubling up to UNIFORM_BLOCK
  while they stay), drawn once per row and sliced per step. The numbers are the ones one draw
  per step would give: torch's CPU generator fills a tensor serially, so a stream does not depend on how it is
  chunked (`tests/test_batch_rows.py` checks it). When rows retire, move or join, the rows that stay keep their
  unused uniforms (one gather) and a new row draws as many; uniforms a row drew but did not use go back to its
  sequence and come first in its next draw: each sample consumes exactly its own stream, in order, whatever batches it ran in.
"""

from __future__ import annotations

import torch

from tlt.rollout.sequence import Sequence, same_rows
from tlt.sampling import RowSampling

UNIFORM_BLOCK = 256  # uniforms per row drawn at once: 256 plain steps, or several speculative steps


class BatchRows:
    """The host-side inputs of the running rows' steps, rebuilt only when the rows change (by identity, in order)."""

    def __init__(self, block: int = UNIFORM_BLOCK):
        self.block = block
        self._rows: list[Sequence] = []
        self._settings: RowSampling | None = None
        self._uniforms: torch.Tensor | None = None  # [B, width]: each row's next uniforms from column _offset
        self._offset = 0
        self._refills = 0  # blocks drawn since the rows last changed

    def settings(self, seqs: list[Sequence]) -> RowSampling:
        """The rows' sampling settings as host tensors (the same object while the rows stay the same)."""
        self._hold(seqs)
        if self._settings is None:
            self._settings = RowSampling.from_params([s.request.params for s in seqs], "cpu")
        return self._settings

    def uniforms(self, seqs: list[Sequence], count: int) -> torch.Tensor:
        """[B, count] host uniforms: row b's next `count` from its sample's own stream."""
        self._hold(seqs)
        if self._uniforms is None or self._offset + count > self._uniforms.shape[1]:
            self._release_uniforms()
            # Rows that just changed may change again soon (a tail retires rows often): small blocks first,
            # doubling while the rows stay, so a redraw after each change costs little more than one step's.
            width = max(count, min(self.block, count << min(self._refills + 2, 16)))
            self._refills += 1
            self._uniforms = torch.stack([seq.take_uniforms(width) for seq in seqs]) if seqs else \
                torch.empty(0, width)
        start = self._offset
        self._offset += count
        return self._uniforms[:, start:self._offset]

    def uniforms_apart(self, seqs: list[Sequence], count: int) -> torch.Tensor:
        """[B, count] for rows this bank does not hold (a prefill's new samples), leaving the held rows' blocks
        as they are: the running rows keep theirs through an admission."""
        held = {id(seq) for seq in self._rows}
        if any(id(seq) in held for seq in seqs):
            return self.uniforms(seqs, count)
        return torch.stack([seq.take_uniforms(count) for seq in seqs])

    def release(self) -> None:
        """Forget the rows; their unused uniforms go back to their sequences."""
        self._release_uniforms()
        self._rows, self._settings = [], None

    def _hold(self, seqs: list[Sequence]) -> None:
        if same_rows(self._rows, seqs):
            return
        self._settings = None
        if not self._keep_subset(seqs):
            self.release()
        self._rows, self._refills = list(seqs), 0

    def _keep_subset(self, seqs: list[Sequence]) -> bool:
        """Rows retired, moved or admitted: each row that stays keeps its unused uniforms (one gather instead of
        one draw per row), a new row draws as many, and the rows that left give theirs back."""
        if self._uniforms is None or not seqs:
            return False
        where = {id(seq): row for row, seq in enumerate(self._rows)}
        picks = [where.get(id(seq)) for seq in seqs]
        kept = [row for row in picks if row is not None]
        if len(set(kept)) != len(kept):  # a sequence twice: never shares its uniforms
            return False
        unused = self._uniforms[:, self._offset:]
        for row in set(range(len(self._rows))) - set(kept):
            self._rows[row].give_back_uniforms(unused[row])
        if len(kept) == len(seqs):
            self._uniforms = unused[torch.tensor(picks)]
        else:
            width = unused.shape[1]
            self._uniforms = torch.stack([unused[row] if row is not None else seq.take_uniforms(width)
                                          for row, seq in zip(picks, seqs)])
        self._offset = 0
        return True

    def _release_uniforms(self) -> None:
        if self._uniforms is not None:
            for seq, unused in zip(self._rows, self._uniforms[:, self._offset:]):
                seq.give_back_uniforms(unused)
        self._uniforms, self._offset = None, 0
