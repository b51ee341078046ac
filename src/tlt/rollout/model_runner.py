"""The model runner on CUDA: the target's forward (and a plain decode step with its sampling) replayed as CUDA graphs.

A decode step of a small model is a few hundred tiny kernels; launched one by one from Python each costs more
than its work (measured on an H100: 14.7 ms eager fp32 per batch-1 step vs ~0.09 ms of weight streaming). A CUDA
graph launches them all at once. A graph replays fixed shapes and fixed addresses, so the runner:

- pads the batch to a bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, ...); padded rows are free cache rows (running rows
  are dense at the front) whose writes are never committed;
- attends over a fixed KV length per graph, the longest row + new tokens rounded up to a block of 256 slots,
  with per-row lengths read from a device buffer (masking), so one graph serves every length inside its block;
- copies inputs into static buffers and reads outputs from static buffers (valid until the next replay).

Sampling runs inside the decode graph from pre-drawn uniforms whenever no row uses top-k/top-p (the RL default);
with filters it runs eagerly after the graph. Graphs are captured lazily, one per (batch bucket, new tokens, KV
block, kind), and dropped when the engine reallocates its cache. Off CUDA the runner is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.models.kv_cache import CacheRows, KVCache
from tlt.models.lean_forward import ForwardOutput, LeanForward
from tlt.rollout.sampling import RowSampling, sample_next

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
KV_BLOCK = 256


def batch_bucket(batch: int, max_rows: int) -> int | None:
    """The smallest bucket >= batch that the cache has rows for (None: run eagerly)."""
    for bucket in BATCH_BUCKETS:
        if batch <= bucket <= max_rows:
            return bucket
    return None


def kv_bucket(longest: int, num_new: int, max_len: int) -> int:
    return min(max_len, -(-(longest + num_new) // KV_BLOCK) * KV_BLOCK)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor, ...]


@dataclass
class _Buffers:
    """Static inputs shared by every graph of one (batch bucket, new tokens, kind). Rows from `padded_from` on
    hold padding (length 0, an identity tree); they are rewritten only when the batch size changes."""

    inputs: dict[str, torch.Tensor]
    padded_from: int | None = None


class GraphRunner:
    """CUDA-graph replays of `LeanForward.run` over one engine's KV cache."""

    def __init__(self, forward: LeanForward):
        if forward.device.type != "cuda":
            raise ValueError("GraphRunner needs a model on CUDA")
        self.forward = forward
        self._cache: KVCache | None = None
        self._graphs: dict[tuple, _Graph] = {}
        self._buffers: dict[tuple, _Buffers] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.captures = 0  # graphs captured so far (benchmarks and tests read it)

    @property
    def device(self):
        return self.forward.device

    def reset(self) -> None:
        """Forget every graph (their addresses point into buffers about to be freed)."""
        self._graphs.clear()
        self._buffers.clear()
        self._cache = None
        # A private pool is released with the last graph that used it: later captures need a fresh handle
        # (reusing the old one trips the caching allocator's use_count assert, seen on the third RL step).
        self._pool = torch.cuda.graph_pool_handle()

    # -- the two entry points ----------------------------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor, cache: CacheRows, *, positions: torch.Tensor | None = None,
                 new_token_mask: torch.Tensor | None = None, logits_at="all") -> ForwardOutput:
        """`LeanForward.__call__` for rows starting at cache row 0 with logits at every new token (decode,
        verification); anything else runs eagerly. The outputs are views of static buffers."""
        batch, num_new = input_ids.shape
        bucket = self._bucket(cache, batch)
        if bucket is None or not (isinstance(logits_at, str) and logits_at == "all"):
            return self.forward(input_ids, cache, positions=positions, new_token_mask=new_token_mask,
                                logits_at=logits_at)
        lengths = cache.lengths
        if positions is None:
            positions = lengths[:, None] + torch.arange(num_new)[None, :]
        inputs = {"ids": input_ids, "positions": positions, "lengths": lengths}
        if new_token_mask is not None:
            inputs["tree"] = new_token_mask
        kv_len = kv_bucket(int(lengths.max()), num_new, cache.cache.max_len)
        kind = "tree" if new_token_mask is not None else "causal"
        logits, hidden = self._replay((bucket, num_new, kind), kv_len, batch, inputs)
        return ForwardOutput(logits[:batch], hidden[:batch])

    def decode(self, input_ids: torch.Tensor, cache: CacheRows, settings: RowSampling, uniforms: torch.Tensor):
        """One plain decode step: (tokens [B], log-probs [B], hidden [B, 1, H]); sampling is in the graph
        unless a row filters with top-k/top-p. Outputs are views of static buffers."""
        batch = input_ids.shape[0]
        bucket = self._bucket(cache, batch)
        if bucket is None or settings.any_filtered:
            out = self(input_ids, cache)
            tokens, logprobs = sample_next(out.logits[:, 0], settings, uniforms[:, 0].to(self.device))
            return tokens, logprobs, out.hidden
        lengths = cache.lengths
        inputs = {"ids": input_ids, "lengths": lengths, "temperature": settings.temperature,
                  "greedy": settings.greedy, "uniforms": uniforms}
        kind = ("decode", settings.any_tempered, settings.any_greedy, settings.all_greedy)
        kv_len = kv_bucket(int(lengths.max()), 1, cache.cache.max_len)
        tokens, logprobs, hidden = self._replay((bucket, 1, kind), kv_len, batch, inputs)
        return tokens[:batch], logprobs[:batch], hidden[:batch]

    # -- capture and replay ------------------------------------------------------------------------------------

    def _bucket(self, cache: CacheRows, batch: int) -> int | None:
        if cache.start != 0:
            return None
        if self._cache is not cache.cache:  # a new cache: graphs of the old one point at freed buffers
            if self._cache is not None:
                self.reset()
            self._cache = cache.cache
        return batch_bucket(batch, cache.cache.max_rows)

    def _replay(self, slot: tuple, kv_len: int, batch: int, inputs: dict[str, torch.Tensor]):
        buffers = self._buffers.get(slot)
        if buffers is None:
            buffers = self._buffers[slot] = _Buffers(self._static_inputs(slot, inputs))
        self._fill(buffers, inputs, batch)
        key = (*slot, kv_len)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(slot, kv_len, buffers.inputs)
        graph.graph.replay()
        return graph.outputs

    def _static_inputs(self, slot: tuple, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        bucket = slot[0]
        return {name: torch.zeros((bucket, *t.shape[1:]), dtype=t.dtype, device=self.device)
                for name, t in inputs.items()}

    @staticmethod
    def _fill(buffers: _Buffers, inputs: dict[str, torch.Tensor], batch: int) -> None:
        """Copy this step's inputs into the static buffers; padded rows get length 0 and an identity tree."""
        repad = buffers.padded_from != batch
        buffers.padded_from = batch
        for name, value in inputs.items():
            static = buffers.inputs[name]
            static[:batch].copy_(value, non_blocking=True)
            if repad and batch < static.shape[0]:
                pad = static[batch:]
                if name == "tree":
                    pad.copy_(torch.eye(pad.shape[-1], dtype=torch.bool, device=pad.device).expand_as(pad))
                elif name in ("temperature", "uniforms"):
                    pad.fill_(0.5)
                else:
                    pad.zero_()

    def _capture(self, slot: tuple, kv_len: int, static: dict[str, torch.Tensor]) -> _Graph:
        bucket, _, kind = slot
        rows = self._cache.rows(0, bucket)
        step = (lambda: self._decode_body(rows, kv_len, kind, static)) if kind[0] == "decode" else \
            (lambda: self._forward_body(rows, kv_len, static))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialization (cuBLAS handles, workspaces) off the graph
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = step()
        self.captures += 1
        return _Graph(graph, outputs)

    def _forward_body(self, rows: CacheRows, kv_len: int, static: dict[str, torch.Tensor]):
        out = self.forward.run(static["ids"], rows, static["lengths"], positions=static["positions"],
                               new_token_mask=static.get("tree"), logits_at="all", kv_len=kv_len)
        return out.logits, out.hidden

    def _decode_body(self, rows: CacheRows, kv_len: int, kind: tuple, static: dict[str, torch.Tensor]):
        _, any_tempered, any_greedy, all_greedy = kind
        out = self.forward.run(static["ids"], rows, static["lengths"], logits_at="all", kv_len=kv_len)
        settings = RowSampling(static["temperature"], torch.zeros_like(static["ids"][:, 0]),
                               torch.ones_like(static["temperature"]), static["greedy"], any_tempered, False,
                               any_greedy, all_greedy)
        tokens, logprobs = sample_next(out.logits[:, 0], settings, static["uniforms"][:, 0])
        return tokens, logprobs, out.hidden
