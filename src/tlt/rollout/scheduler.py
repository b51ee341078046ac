"""Scheduler: which samples of one `generate()` run, in which cache rows; never a forward.

Samples wait in a queue until rows free up; an admission takes queued samples in order while rows are free and
one prefill's padded prompt tokens stay within a budget. Invariant: `running[i]` decodes in cache row i, so the
running rows are a dense prefix of the cache (a zero-copy slice): a finished row is filled by the last running
row (`move_row` of whatever holds the rows' state, the model runner), and admitted rows are appended after it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tlt.rollout.request import Request, SampleOutput
from tlt.rollout.sequence import Sequence
from tlt.sampling import sample_generator

PREFILL_TOKEN_BUDGET = 8192  # padded prompt tokens per prefill forward: bounds its activation memory


@dataclass
class _Pending:
    """Samples [first, first + count) of a request, not yet admitted."""

    request_index: int
    first: int
    count: int


class Scheduler:
    """The waiting queue, the running sequences (row i = running[i]) and the finished ones of one rollout.

    max_batch_size: rows decoded together. eos_token_ids: stop tokens of requests that give none."""

    def __init__(self, requests: list[Request], max_batch_size: int, eos_token_ids: tuple[int, ...]):
        self.requests = requests
        self.max_batch_size = max_batch_size
        self.eos_token_ids = eos_token_ids
        self.waiting = deque(_Pending(i, 0, r.n) for i, r in enumerate(requests))
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []

    # -- where the rollout stands ----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    @property
    def running_rows(self) -> int:
        return len(self.running)

    @property
    def waiting_samples(self) -> int:
        return sum(p.count for p in self.waiting)

    @property
    def max_rows(self) -> int:
        """Cache rows this rollout can use at once."""
        return min(self.max_batch_size, sum(r.n for r in self.requests))

    @property
    def max_len(self) -> int:
        """Cache slots the longest sample can commit: its prompt and its whole budget."""
        return max(len(r.prompt_ids) + r.params.max_new_tokens for r in self.requests)

    # -- admission -------------------------------------------------------------------------------------------

    def admit(self) -> list[list[Sequence]]:
        """The queued samples that fit now, one group per prompt (its samples share one prefill; the first is
        the group's leader). Empty when no row is free or nothing waits. Rows are taken by `start`."""
        free = self.max_batch_size - len(self.running)
        groups: list[_Pending] = []
        while self.waiting and free > 0:
            pending = self.waiting[0]
            padded = max(self._prompt_len(g) for g in groups + [pending]) * (len(groups) + 1)
            if groups and padded > PREFILL_TOKEN_BUDGET:
                break
            take = min(pending.count, free)
            groups.append(_Pending(pending.request_index, pending.first, take))
            if take == pending.count:
                self.waiting.popleft()
            else:
                self.waiting[0] = _Pending(pending.request_index, pending.first + take, pending.count - take)
            free -= take
        return [self._sequences(g) for g in groups]

    def start(self, sequences: list[Sequence]) -> None:
        """Admitted sequences, in the order the prefill placed them in the rows after the running ones."""
        self.running.extend(sequences)

    def _prompt_len(self, pending: _Pending) -> int:
        return len(self.requests[pending.request_index].prompt_ids)

    def _sequences(self, pending: _Pending) -> list[Sequence]:
        # Created in admission order: a request without a seed draws its generators' seeds from the global RNG.
        request = self.requests[pending.request_index]
        params = request.params
        stop = frozenset(params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids)
        return [Sequence(pending.request_index, index, request, stop,
                         sample_generator(params.seed, request.stream_at(pending.request_index), index))
                for index in range(pending.first, pending.first + pending.count)]

    # -- finished rows ---------------------------------------------------------------------------------------

    def retire(self, rows, collect_features=None) -> int:
        """Move finished sequences out of the running rows; returns how many finished.

        rows: what holds the rows' state (the model runner): `move_row(src, dst)` and
        `committed_features(row, start, end)`. With collect_features, every finished row's features are handed
        over first, while its row still holds them (a move below may overwrite it)."""
        done = [i for i, s in enumerate(self.running) if s.finish_reason is not None]
        if collect_features is not None:
            for index in done:
                collect_features(*rows.committed_features(index, *_feature_span(self.running[index])))
        for index in reversed(done):  # from the back: the last running row is never one still to retire
            last = len(self.running) - 1
            self.finished.append(self.running[index])
            if index != last:
                rows.move_row(last, index)
                self.running[index] = self.running[last]
            self.running.pop()
        return len(done)

    def outputs(self) -> list[SampleOutput]:
        """Every finished sample, ordered by (request, sample)."""
        ordered = sorted(self.finished, key=lambda s: (s.request_index, s.sample_index))
        return [s.output() for s in ordered]


def _feature_span(seq: Sequence) -> tuple[int, int]:
    """The slots of a finished sample's drafter features: from its last prompt token to its response's
    second-to-last token (slot p + j holds response token j; the last one was emitted but never fed). A
    speculative step may have committed slots past a stop token: they are not the sample's and are left out."""
    start = len(seq.request.prompt_ids) - 1
    return start, start + len(seq.tokens)
