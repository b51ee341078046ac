"""Steps launched on the device whose tokens have not reached the host yet (the graph path's overlapped steps).

A step's output is copied out before the next replay can overwrite its graph's buffer (stream order): on CUDA into
pinned memory behind an event, so nothing waits for the device until the tokens are needed (`ModelRunner`'s
overlapped plain and speculative steps: step n + 1 launched from step n's results on the device, then step n's
tokens appended while the device runs n + 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tlt.models.kv_cache import CacheRows
from tlt.rollout.graph_runner import StepStart
from tlt.rollout.sequence import Sequence
from tlt.speculative.acceptance import Acceptance
from tlt.speculative.decoder import SpeculativeDecoder, unpack
from tlt.speculative.strategy import SpecStrategy


@dataclass
class InFlight:
    """A launched plain step whose tokens are not yet appended: its rows, its output on the device (the next
    step's input) and the host copy under way (`done`: recorded after it on CUDA; None where it is already done)."""

    seqs: list[Sequence]
    packed: torch.Tensor
    host: torch.Tensor
    done: "torch.cuda.Event | None"


@dataclass
class SpeculativeInFlight(InFlight):
    """A launched speculative step: `packed` is its `pack(acceptance)` on the device; `committed` each row's
    committed length it started from (device).
    drafter_reset: a drafter was swapped in since the launch, its state reset: the step's caught-up pairs are
    not the new drafter's (its state is rebuilt), and no step may follow this one on the device."""

    strategy: SpecStrategy
    committed: torch.Tensor
    drafter_reset: bool = False

    def following(self, longest: int) -> tuple[torch.Tensor, StepStart]:
        """The next step's start from this one's results, on the device: (pending tokens [B], StepStart). Each
        row's last emitted token is pending; its committed length grows by what it emitted, and its drafter has
        then seen every pair committed before this step. longest: the largest committed length this step
        started from, which the host holds exactly while it is in flight; the new lengths are bounded by it plus
        the deepest path (a bound carried from step to step grew by depth + 1 each step: found by review)."""
        packed = self.packed
        width = (packed.shape[1] - 1) // 3  # `decoder.pack`: tokens, log-probs, path, then the accepted count
        accepted = packed[:, -1].long()
        pending = packed[:, :width].gather(1, accepted[:, None])[:, 0].long()
        committed = self.committed + (accepted + 1).to(self.committed.dtype)
        return pending, StepStart(committed, self.committed, longest + self.strategy.depth + 1, longest)


@dataclass
class Landed:
    """What appending in-flight steps gave: tokens appended, the steps landed and, for speculative ones, their
    arm and rows by accepted draft tokens (summed)."""

    tokens: int = 0
    steps: int = 0
    arm: SpecStrategy | None = None
    accepted_hist: tuple = field(default=())

    def __add__(self, other: "Landed") -> "Landed":
        return Landed(self.tokens + other.tokens, self.steps + other.steps, other.arm or self.arm,
                      merge_hists(self.accepted_hist, other.accepted_hist))


def merge_hists(a: tuple, b: tuple) -> tuple:
    """Two accepted-draft histograms summed (the shorter one padded with zeros)."""
    return tuple((a[d] if d < len(a) else 0) + (b[d] if d < len(b) else 0) for d in range(max(len(a), len(b))))


def copy_to_host(packed: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Start copying a step's output to the host: on CUDA into pinned memory (a copy into pageable memory would
    wait for the device), with an event marking when it has landed; elsewhere a copy at once."""
    if packed.device.type != "cuda":
        return packed.clone(), None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(packed.device))  # the copy's stream, whatever device is current
    return host, done


def land_plain(step: InFlight) -> Landed:
    """Append a launched plain step's tokens; a sequence that stopped before it (an overlapped step) takes none."""
    if step.done is not None:
        step.done.synchronize()
    host = step.host
    appended = 0
    for seq, token, logprob in zip(step.seqs, host[:, 0].long().tolist(), host[:, 1].float().tolist()):
        if seq.finish_reason is None:
            seq.append(token, logprob)
            appended += 1
    return Landed(appended, 1)


def land_speculative(step: SpeculativeInFlight, rows: CacheRows, decoder: SpeculativeDecoder) -> Landed:
    """Commit a launched speculative step on the host lengths and append its tokens (`append_accepted`)."""
    if step.done is not None:
        step.done.synchronize()
    acceptance = decoder.commit(rows, decoder.draft_rows(rows), unpack(step.host),
                                drafter_fed=not step.drafter_reset)
    return Landed(append_accepted(step.seqs, acceptance), 1, step.strategy,
                  accepted_hist(acceptance, step.strategy))


def append_accepted(seqs: list[Sequence], acceptance: Acceptance) -> int:
    """Append each row's emitted tokens, none past its stop token or budget; a sequence that stopped before the
    step (an overlapped one) takes none. Returns how many were appended."""
    appended = 0
    for seq, tokens, logprobs, count in zip(seqs, acceptance.tokens.tolist(), acceptance.logprobs.tolist(),
                                            acceptance.emitted.tolist()):
        if seq.finish_reason is not None:
            continue
        for token, logprob in zip(tokens[:count], logprobs[:count]):
            seq.append(token, logprob)
            appended += 1
            if seq.finish_reason is not None:
                break  # nothing after a stop token or past the length budget is emitted
    return appended


def accepted_hist(acceptance: Acceptance, strategy: SpecStrategy) -> tuple:
    """Rows that accepted 0, 1, ..., depth draft tokens."""
    return tuple(torch.bincount(acceptance.accepted, minlength=strategy.depth + 1).tolist())
