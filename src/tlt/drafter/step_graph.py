"""MicroStepGraph: the drafter's training micro-step (forward, loss, backward) captured as one CUDA graph.

Why: on one GPU the drafter trains on a thread beside the decode loop (drafter/tail_trainer.py). Each launch of
an eager micro-step (~170 at the default model's shape: benchmarks/tail_step_ops.py) is Python that holds the
GIL, which the decode loop needs between its own replayed steps; the H200 measured the decoding a tail trainer
overlapped 19% slower (#15's target: 3%). Replayed, a micro-step is a few host calls: copy the rows into the
graph's buffers, replay.

What a replay takes as fixed, and how each is kept so:
- the rows' shape: [rows, row_length], the last chunk of a step padded with weightless rows (trainer._row_chunks),
  and the loss computed at every pair with per-pair weights (DrafterTrainer.loss: no indexing by the real pairs);
- the parameters and their .grad tensors: the graph accumulates into those gradients, so the trainer zeroes them
  and never drops them (set_to_none=False) while it has a graph;
- the target's embedding and lm_head: policy updates and rollout-copy refreshes write them in place, and the
  draft vocabulary's lm_head slice is re-copied in place before a step when the lm_head changed
  (`EagleDrafter.head_weight`).
Whether any of these tensors moved (another drafter copy, gradients set to None) is checked on the host before
each step; if so the micro-step is captured again.

Captured in thread_local mode, on a stream of its own: the decode loop goes on meanwhile on its thread (it reads
values, allocates, replays its own graphs), and the process-wide default capture stream stays free for the
rollout's graph runner. Feature noise is not captured (a replay would repeat its draws): the trainer stays eager.
"""

from __future__ import annotations

import logging

import torch

from tlt.capture_lock import CAPTURING
from tlt.drafter.buffer import PackedPairs

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on the capture stream first (cuBLAS workspaces, autograd's lazy state), as torch asks


class MicroStepGraph:
    """A trainer's micro-step over `rows` packed rows of `row_length` pairs, captured on first use."""

    def __init__(self, trainer, rows: int, row_length: int):
        self.trainer, self.rows, self.row_length = trainer, rows, row_length
        self.graph: torch.cuda.CUDAGraph | None = None
        self.buffers: tuple[PackedPairs, torch.Tensor] | None = None  # what the graph reads: rows, weights
        self.sums: dict[str, torch.Tensor] = {}  # the step's metrics, accumulated by its replays
        self._stream: torch.cuda.Stream | None = None
        self._key: tuple | None = None

    def fits(self, rows: int) -> bool:
        return rows == self.rows

    def start_step(self, rows: PackedPairs, weights: torch.Tensor) -> None:
        """Before a step's first micro-step (its gradients zeroed): capture if needed (with `rows` as the
        warm-up's data), and zero the metric sums."""
        self.trainer.drafter.head_weight()  # the draft vocabulary's lm_head slice, re-copied if the policy moved
        if self.graph is None or self._key != self._tensors_key():
            self._capture(rows, weights)
        torch._foreach_zero_(list(self.sums.values()))

    def run(self, rows: PackedPairs, weights: torch.Tensor) -> None:
        """One micro-step: its gradient added to the parameters' .grad, its weighted metrics to `sums`."""
        moved = self.trainer._to_device(rows, weights)
        torch._foreach_copy_(self._flat(self.buffers), self._flat(moved))
        self.graph.replay()

    # -- capture ----------------------------------------------------------------------------------------------

    def _capture(self, rows: PackedPairs, weights: torch.Tensor) -> None:
        trainer = self.trainer
        device = trainer.drafter.fc.weight.device
        self.graph, self.buffers = None, trainer._to_device(rows, weights)  # buffers of its own, outside the pool
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream, current = self._stream, torch.cuda.current_stream(device)
        stream.wait_stream(current)
        params = self._params()
        try:
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):  # allocates the gradients the graph will accumulate into
                    loss, parts = trainer.loss(*self.buffers, noise=False)
                    loss.backward()
                # the warm-ups' gradients are not the step's (a parameter the loss does not reach has none)
                torch._foreach_zero_([p.grad for p in params if p.grad is not None])
                self.sums = {key: torch.zeros((), dtype=torch.float32, device=device) for key in parts}
                with CAPTURING:  # not beside the decode loop's own captures (tlt/capture_lock.py)
                    graph = self._captured(parts)
        finally:
            # also after a failure: the eager step that follows runs on `current` and writes the parameters the
            # warm-ups on `stream` may still be reading
            current.wait_stream(stream)
        self.graph, self._key = graph, self._tensors_key()
        log.info("drafter micro-step captured as a CUDA graph (%d rows of %d pairs)", self.rows, self.row_length)

    def _captured(self, parts: dict) -> torch.cuda.CUDAGraph:
        """The micro-step recorded on the current (capture) stream. A failure inside the capture raises itself,
        not capture_end's consequent "invalidated capture", which would hide the cause."""
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            loss, parts = self.trainer.loss(*self.buffers, noise=False)
            loss.backward()
            for key, value in parts.items():
                self.sums[key].add_(value)
        except BaseException:
            try:
                graph.capture_end()  # ends the stream's capture mode; its own error is the one above's echo
            except Exception:  # noqa: BLE001
                pass
            raise
        graph.capture_end()
        return graph

    def _params(self) -> list[torch.Tensor]:
        return [p for p in self.trainer.drafter.parameters() if p.requires_grad]

    def _tensors_key(self) -> tuple:
        """Where every tensor the graph reads or writes lives (None for a gradient that is not there)."""
        drafter = self.trainer.drafter
        target = drafter.target
        rotary = getattr(target.decoder.rotary_emb, "inv_freq", None)  # RoPE's frequencies, a buffer it reads
        outside = (target.decoder.embed_tokens.weight.data_ptr(), drafter.head_weight().data_ptr(),
                   None if rotary is None else rotary.data_ptr(), drafter.fc.weight.dtype)
        return outside + tuple((p.data_ptr(), None if p.grad is None else p.grad.data_ptr()) for p in self._params())

    @staticmethod
    def _flat(batch: tuple[PackedPairs, torch.Tensor]) -> list[torch.Tensor]:
        rows, weights = batch
        return [rows.input_tokens, rows.input_features, rows.target_features, rows.positions, rows.attention_mask,
                rows.valid, weights]
