"""CUDA graphs of the rollout's steps: the target's forward, a plain decode step with its sampling, a whole SD step.

A decode step of a small model is a few hundred tiny kernels; launched one by one from Python each costs more
than its work (measured on an H100: 14.7 ms eager fp32 per batch-1 step vs ~0.09 ms of weight streaming). A CUDA
graph launches them all at once. A graph replays fixed shapes and fixed addresses, so the runner:

- pads the batch to a bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, ...); padded rows are free cache rows (running rows
  are dense at the front) whose writes are never committed;
- attends over a fixed KV length per graph, the longest row + new tokens rounded up to a block of 256 slots,
  with per-row lengths read from a device buffer (masking), so one graph serves every length inside its block;
- copies inputs into static buffers and reads outputs from static buffers (valid until the next replay).

Sampling (temperature, top-k, top-p) runs inside the decode graph from pre-drawn uniforms; top-k/top-p rows
sort the vocabulary there instead of reading on the host how many candidates hold their nucleus (graphs of
filtered batches are their own kind). A whole speculative step (drafter catch-up, drafting, tree, verify,
acceptance, KV commit) is one graph per (batch bucket, strategy, sampling kind, KV blocks): Python only
schedules, and one device-to-host copy per step returns what was emitted. Graphs are captured lazily and dropped
when the model runner reallocates its cache or changes its drafter.

Off CUDA the model runner (rollout/model_runner.py) steps eagerly without one; tests build one with
capture=False, which runs the same bodies on the same padded static buffers eagerly, so the bucketing and
padding logic is checked on any device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tlt.capture_lock import CAPTURING
from tlt.models.kv_cache import CacheRows, KVCache
from tlt.models.attention import ATTENTION_ALIGN
from tlt.models.lean_forward import ForwardOutput, LeanForward, compile_static
from tlt.sampling import RowSampling, sample_next
from tlt.speculative.decoder import (
    SpecOutcome,
    SpeculativeDecoder,
    StepInputs,
    StepShape,
    spans,
)
from tlt.speculative.strategy import SpecStrategy

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Attention kernels a captured step may use (the kernel is picked at capture, and replays keep it). Not cuDNN,
# which recent torch prefers for masked bf16 attention on SM90: some cuDNN 9.x versions make illegal memory
# accesses under CUDA graphs past 1024 KV slots with a non-causal mask (TransformerEngine disables it there),
# exactly the rollout's case, and an illegal access ends the CUDA context. Flash takes no mask either way.
CAPTURED_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
KV_BLOCK = 256
SETTINGS_INPUTS = frozenset({"temperature", "greedy", "top_k", "top_p"})  # fixed while the batch's rows are


def batch_bucket(batch: int, max_rows: int) -> int | None:
    """The smallest bucket >= batch that the cache has rows for (None: run eagerly)."""
    for bucket in BATCH_BUCKETS:
        if batch <= bucket <= max_rows:
            return bucket
    return None


def kv_bucket(longest: int, num_new: int, max_len: int) -> int:
    return min(max_len, -(-(longest + num_new) // KV_BLOCK) * KV_BLOCK)


def cache_capacity(length: int, graphs: bool) -> int:
    """Cache slots for `length`: with graphs whole KV blocks, so that a span `kv_bucket` clamps to the capacity
    stays on the block grid; eagerly a multiple of 16. Either way every attention span can be a multiple of 16,
    which SDPA's memory-efficient kernel wants of a mask's last dim (it pads a copy every call otherwise)."""
    multiple = KV_BLOCK if graphs else ATTENTION_ALIGN
    return -(-length // multiple) * multiple


@dataclass
class _Graph:
    """A captured step (graph + its static outputs), or, without capture, the step itself run on each replay."""

    graph: torch.cuda.CUDAGraph | None
    outputs: tuple[torch.Tensor, ...] | None
    step: object

    def replay(self) -> tuple[torch.Tensor, ...]:
        if self.graph is None:
            return self.step()
        self.graph.replay()
        return self.outputs


@dataclass
class _Buffers:
    """Static inputs shared by every graph of one (batch bucket, shape, kind). Rows from `padded_from` on hold
    padding (length 0, an identity tree); they are rewritten only when the batch size changes. `sources`: the
    host tensor each buffer was last filled from; the same object again (the rows' settings while the batch's
    rows stay the same: rollout/batch_rows.py) is not copied again (held here, so an id is never reused). Only
    the settings are compared: lengths are host views written in place."""

    inputs: dict[str, torch.Tensor]
    padded_from: int | None = None
    sources: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepStart:
    """Where a speculative step starts: each row's committed length and the pairs its drafter has seen (host
    tensors, or device tensors when the step follows one still in flight), and the host's bounds on their
    largest values, which size the attention spans."""

    committed: torch.Tensor
    seen: torch.Tensor
    longest: int
    most_seen: int


class GraphRunner:
    """CUDA-graph replays of `LeanForward.run` and of whole speculative steps over one model runner's KV cache."""

    def __init__(self, forward: LeanForward, *, capture: bool | None = None):
        capture = forward.device.type == "cuda" if capture is None else capture
        if capture and forward.device.type != "cuda":
            raise ValueError("GraphRunner captures CUDA graphs: it needs a model on CUDA")
        self.forward = forward
        self.capture = capture
        self._cache: KVCache | None = None
        self._speculative: tuple | None = None  # (decoder, its drafter cache) the speculative graphs read
        # SpeculativeDecoder.run compiled, with a compiled forward; kept across resets (Dynamo's entries stay valid)
        self._compiled_step = None
        self.uncompiled_arms: set[str] = set()  # arms whose whole step Inductor failed to compile: run uncompiled
        self._graphs: dict[tuple, _Graph] = {}
        self._buffers: dict[tuple, _Buffers] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        # this runner's own capture stream on its device: torch's default one is made once per process, on the
        # device current at the first capture, so a worker on another GPU would capture on a foreign stream
        self._capture_stream = torch.cuda.Stream(forward.device) if capture else None
        self.captures = 0  # graphs captured so far (benchmarks and tests read it)
        # Graphs built so far, captured or (capture=False) run once ahead of their first replay: the step that
        # builds one also pays its warm-up and capture (50-300 ms on CUDA vs a few ms per replay).
        self.new_graphs = 0

    @property
    def device(self):
        return self.forward.device

    def reset(self) -> None:
        """Forget every graph (their addresses point into buffers about to be freed)."""
        self._graphs.clear()
        self._buffers.clear()
        self._cache = None
        self._speculative = None
        # A private pool is released with the last graph that used it: later captures need a fresh handle
        # (reusing the old one trips the caching allocator's use_count assert, seen on the third RL step).
        if self.capture:
            self._pool = torch.cuda.graph_pool_handle()

    # -- the entry points --------------------------------------------------------------------------------------

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
        rows = self._cache.rows(0, bucket)
        logits, hidden = self._replay((bucket, num_new, kind), (kv_len,), batch, inputs,
                                      lambda static: self._forward_body(rows, kv_len, static))
        return ForwardOutput(logits[:batch], hidden[:batch])

    def decode(self, input_ids: torch.Tensor, cache: CacheRows, settings: RowSampling, uniforms: torch.Tensor, *,
               store_drafter_inputs: bool = False) -> torch.Tensor:
        """One plain decode step: [B, 2] float64 on the device, each row's token id and log-prob (ids < 2^53 are
        exact), for one device-to-host copy. Sampled inside the graph.
        store_drafter_inputs: the graph also writes the step's token ids and features into the cache's slot
        data (kernels that would otherwise be launched one by one after every replay). A static buffer's view."""
        batch = input_ids.shape[0]
        bucket = self._bucket(cache, batch)
        if bucket is None:
            out = self(input_ids, cache)
            if store_drafter_inputs:
                cache.write_drafter_inputs(cache.lengths.to(self.device), input_ids.to(self.device), out.hidden)
            tokens, logprobs = sample_next(out.logits[:, 0], settings.to(self.device), uniforms[:, 0].to(self.device))
            return pack_tokens(tokens, logprobs)
        lengths = cache.lengths
        inputs = {"ids": input_ids, "lengths": lengths, **_settings_inputs(settings), "uniforms": uniforms}
        kind = ("decode", store_drafter_inputs, *_sampling_kind(settings))
        kv_len = kv_bucket(int(lengths.max()), 1, cache.cache.max_len)
        rows = self._cache.rows(0, bucket)
        packed, = self._replay((bucket, 1, kind), (kv_len,), batch, inputs,
                               lambda static: self._decode_body(rows, kv_len, kind, static))
        return packed[:batch]

    def speculative_step(self, decoder: SpeculativeDecoder, cache: CacheRows, pending: torch.Tensor,
                         settings: RowSampling, uniforms: torch.Tensor, strategy: SpecStrategy) -> SpecOutcome | None:
        """One whole speculative step as a graph; None when it must run eagerly (rows not from cache row 0, no
        bucket). pending [B] and uniforms [B, U] may be host tensors: they are copied into
        static buffers. Returns host results; the caches' host lengths are advanced."""
        packed = self.launch_speculative(decoder, cache, pending, settings, uniforms, strategy)
        if packed is None:
            return None
        return SpecOutcome(decoder.finish(cache, decoder.draft_rows(cache), packed), 0.0, 0.0)

    def launch_speculative(self, decoder: SpeculativeDecoder, cache: CacheRows, pending: torch.Tensor,
                           settings: RowSampling, uniforms: torch.Tensor, strategy: SpecStrategy,
                           after: "StepStart | None" = None) -> torch.Tensor | None:
        """Replay a speculative step and return its `pack(...)` output on the device (a static buffer's view:
        valid until the next replay); nothing waits for it and no host length moves (`decoder.commit` does,
        with the results). None: no graph for it (see `speculative_step`).
        after: this step follows one not yet committed on the host: its committed and seen lengths are device
        tensors, and the host gives only bounds for the attention spans (`StepStart`)."""
        batch = pending.shape[0]
        bucket = self._bucket(cache, batch)
        if bucket is None:
            return None
        self._adopt(decoder)
        # A row misses the accepted path + 1 pair after an SD step, and one pair more when a plain step came
        # between: + 2 spares `bring_within` an eager drafter pass and its host syncs then (one padded pair)
        width = strategy.depth + 2
        if after is None:
            decoder.bring_within(cache, width)
            draft_rows = decoder.draft_rows(cache)
            after = StepStart(cache.lengths, draft_rows.lengths, int(cache.lengths.max()),
                              int(draft_rows.lengths.max()))
        target_max, draft_max = cache.cache.max_len, decoder.cache.max_len
        target_kv, draft_kv = spans(strategy, after.longest, after.most_seen, width)
        shape = StepShape(strategy, width, kv_bucket(target_kv, 0, target_max), kv_bucket(draft_kv, 0, draft_max))
        inputs = {"pending": pending, "committed": after.committed, "seen": after.seen,
                  **_settings_inputs(settings), "uniforms": uniforms}
        kind = ("speculative", strategy.name, *_sampling_kind(settings))
        decoder.drafter.head_weight()  # re-slices the draft head in place if the target's lm_head changed
        rows, all_draft_rows = self._cache.rows(0, bucket), decoder.cache.rows(0, bucket)
        step = self._step_function(decoder)
        body = lambda static: self._speculative_body(step, rows, all_draft_rows, shape, kind, static)
        packed, = self._replay((bucket, width, kind), (shape.target_kv, shape.draft_kv), batch, inputs, body)
        return packed[:batch]

    # -- capture and replay ------------------------------------------------------------------------------------

    def serves(self, cache: CacheRows) -> bool:
        """Whether these rows' steps replay graphs (rows from cache row 0, a batch within the buckets)."""
        return cache.start == 0 and batch_bucket(cache.count, cache.cache.max_rows) is not None

    def _bucket(self, cache: CacheRows, batch: int) -> int | None:
        if cache.start != 0:
            return None
        if self._cache is not cache.cache:  # a new cache: graphs of the old one point at freed buffers
            if self._cache is not None:
                self.reset()
            self._cache = cache.cache
        return batch_bucket(batch, cache.cache.max_rows)

    def _adopt(self, decoder: SpeculativeDecoder) -> None:
        """Speculative graphs read one decoder's drafter weights and drafter cache: another one drops them."""
        current = (decoder, decoder.cache)
        if self._speculative is not None and (self._speculative[0] is not decoder
                                              or self._speculative[1] is not decoder.cache):
            cache = self._cache
            self.reset()
            self._cache = cache
        self._speculative = current

    @torch.no_grad()  # a capture under grad mode would record autograd state (callers need not set it)
    def _replay(self, slot: tuple, spans_: tuple, batch: int, inputs: dict[str, torch.Tensor], body):
        buffers = self._buffers.get(slot)
        if buffers is None:
            buffers = self._buffers[slot] = _Buffers(self._static_inputs(slot[0], inputs))
        self._fill(buffers, inputs, batch)
        key = (*slot, *spans_)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(lambda: body(buffers.inputs))
        return graph.replay()

    def _static_inputs(self, bucket: int, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: torch.zeros((bucket, *t.shape[1:]), dtype=t.dtype, device=self.device)
                for name, t in inputs.items()}

    @staticmethod
    def _fill(buffers: _Buffers, inputs: dict[str, torch.Tensor], batch: int) -> None:
        """Copy this step's inputs into the static buffers; padded rows get length 0 and an identity tree."""
        repad = buffers.padded_from != batch
        buffers.padded_from = batch
        for name, value in inputs.items():
            static = buffers.inputs[name]
            if name in SETTINGS_INPUTS:  # never written in place: the same object holds the same values
                if buffers.sources.get(name) is value:  # (another batch size is another object)
                    continue
                buffers.sources[name] = value
            static[:batch].copy_(value, non_blocking=True)
            if repad and batch < static.shape[0]:
                pad = static[batch:]
                if name == "tree":
                    pad.copy_(torch.eye(pad.shape[-1], dtype=torch.bool, device=pad.device).expand_as(pad))
                elif name in ("temperature", "uniforms"):
                    pad.fill_(0.5)
                elif name == "top_p":
                    pad.fill_(1.0)
                else:
                    pad.zero_()

    def _capture(self, step) -> _Graph:
        self.new_graphs += 1
        if not self.capture:  # as on CUDA, the body runs once before its first replay: it must be idempotent
            step()
            return _Graph(None, None, step)
        side = self._capture_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with sdpa_kernel(CAPTURED_ATTENTION):
            with torch.cuda.stream(side):  # warm-up: lazy initialization (cuBLAS handles, workspaces) off the graph
                step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread may launch CUDA work meanwhile (the tail trainer on its own stream,
            # which allocates); "global" would fail its allocations, or this capture, whenever a new bucket is
            # captured.
            with CAPTURING, torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                outputs = step()
        self.captures += 1
        return _Graph(graph, outputs, step)

    # -- the bodies: fixed shapes, static inputs, nothing read on the host ---------------------------------

    def _forward_body(self, rows: CacheRows, kv_len: int, static: dict[str, torch.Tensor]):
        out = self.forward.run(static["ids"], rows, static["lengths"], positions=static["positions"],
                               new_token_mask=static.get("tree"), logits_at="all", kv_len=kv_len)
        return out.logits, out.hidden

    def _decode_body(self, rows: CacheRows, kv_len: int, kind: tuple, static: dict[str, torch.Tensor]):
        out = self.forward.run(static["ids"], rows, static["lengths"], logits_at="all", kv_len=kv_len)
        if kind[1]:  # padded rows write slot 0 of free rows: never committed, as their KV
            rows.write_drafter_inputs(static["lengths"], static["ids"], out.hidden)
        tokens, logprobs = sample_next(out.logits[:, 0], _static_settings(static, kind), static["uniforms"][:, 0])
        return (pack_tokens(tokens, logprobs),)

    def _step_function(self, decoder: SpeculativeDecoder):
        """`decoder.run`, Inductor-compiled as a whole when the forward is (`LeanForward.compile`): the drafter
        passes, tree bookkeeping and acceptance are many small kernels beside the verify forward. One compiled
        function per runner, the decoder an argument: Dynamo guards on the drafter and forward it reads, so a new
        decoder over the same drafter (the cost curve's scratch decoders) reuses the compiled code; each arm
        compiles once (its depth and branching unroll loops)."""
        mode = self.forward.compile_mode
        if mode is None:
            return decoder.run
        if self._compiled_step is None:
            # dynamic=True as in LeanForward.compile: one compile per arm, not one per KV span and batch first met
            self._compiled_step = compile_static(SpeculativeDecoder.run, mode)
        return lambda *args, **kwargs: self._compiled_or_eager(decoder, *args, **kwargs)

    def _compiled_or_eager(self, decoder: SpeculativeDecoder, rows, draft_rows, inputs, shape: StepShape, **kwargs):
        """The compiled step, or, for an arm Inductor cannot compile, the uncompiled one (its verify forward stays
        compiled): a q-sampling tree fails inside Inductor on the CPU (torch 2.13: "vr must not be None for
        symbol q1"). Compiling fails before the step runs (it has no graph breaks), so nothing ran twice."""
        from torch._dynamo.exc import BackendCompilerFailed  # (imported by torch.compile already: no cost)

        arm = shape.strategy.name
        if arm not in self.uncompiled_arms:
            try:
                return self._compiled_step(decoder, rows, draft_rows, inputs, shape, **kwargs)
            except BackendCompilerFailed as error:
                if self.capture and torch.cuda.is_current_stream_capturing():
                    raise  # a compile inside a capture (the warm-up met other guards): its own error, not the arm's
                self.uncompiled_arms.add(arm)
                cause = getattr(error, "inner_exception", None) or error
                log.warning("rollout.compile: Inductor could not compile the speculative step of %s (%s: %s); "
                            "that arm's step runs uncompiled, its verify forward compiled", arm,
                            type(cause).__name__, (str(cause).strip().splitlines() or [""])[0][:200])
        return decoder.run(rows, draft_rows, inputs, shape, **kwargs)

    @staticmethod
    def _speculative_body(step, rows: CacheRows, draft_rows: CacheRows, shape: StepShape, kind: tuple,
                          static: dict[str, torch.Tensor]):
        inputs = StepInputs(static["pending"], static["committed"], static["seen"], _static_settings(static, kind),
                            static["uniforms"])
        return (step(rows, draft_rows, inputs, shape, sync_free=True),)


def pack_tokens(tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """[B, 2] float64: token ids (exact below 2^53) and log-probs, one tensor for one device-to-host copy."""
    return torch.stack([tokens.double(), logprobs.double()], dim=1)


def _sampling_kind(settings: RowSampling) -> tuple[bool, bool, bool, bool]:
    """The host flags a graph's sampling code depends on: part of its key."""
    return settings.any_tempered, settings.any_greedy, settings.all_greedy, settings.any_filtered


def _settings_inputs(settings: RowSampling) -> dict[str, torch.Tensor]:
    """The per-row settings a graph reads from static buffers; top-k/top-p only when some row filters."""
    inputs = {"temperature": settings.temperature, "greedy": settings.greedy}
    if settings.any_filtered:
        inputs.update(top_k=settings.top_k, top_p=settings.top_p)
    return inputs


def _static_settings(static: dict[str, torch.Tensor], kind: tuple) -> RowSampling:
    """Per-row settings over the static buffers; a filtered kind sorts the vocabulary (nothing read on the host)."""
    any_tempered, any_greedy, all_greedy, any_filtered = kind[-4:]
    top_k = static["top_k"] if any_filtered else torch.zeros_like(static["greedy"], dtype=torch.long)
    top_p = static["top_p"] if any_filtered else torch.ones_like(static["temperature"])
    return RowSampling(static["temperature"], top_k, top_p, static["greedy"], any_tempered, any_filtered,
                       any_greedy, all_greedy, sync_free=True)
