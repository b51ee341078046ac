"""ModelRunner: how a rollout step runs — the forward over the KV cache, eager or as CUDA graphs.

It owns the rollout forward, the KV cache (with the per-slot tokens and features the drafter is rebuilt from),
the speculative decoder and, on CUDA, the `GraphRunner` (rollout/graph_runner.py). Its steps take the running
sequences of the scheduler (rollout/scheduler.py), sequence i in cache row i, and append what they sample to
them. Each sample's uniforms come from its own generator, drawn on the host in a fixed count per step, so the
eager and the graph path consume the same random numbers (a block at a time: rollout/batch_rows.py).
"""

from __future__ import annotations

import logging

import torch

from tlt.errors import RequestError
from tlt.models import draft_kernels, sample_kernels, tree_kernels
from tlt.models.kv_cache import CacheRows, KVCache
from tlt.models.lean_forward import LeanForward
from tlt.rollout.batch_rows import BatchRows
from tlt.rollout.graph_runner import GraphRunner, batch_bucket, cache_capacity, pack_tokens
from tlt.rollout.in_flight import (InFlight, Landed, SpeculativeInFlight, accepted_hist, append_accepted,
                                  copy_to_host, land_plain, land_speculative, merge_hists)
from tlt.rollout.request import StepTrace
from tlt.rollout.sequence import Sequence, same_rows
from tlt.sampling import RowSampling, drawing_with, is_integer, sample_next
from tlt.speculative.decoder import SpeculativeDecoder
from tlt.speculative.strategy import SpecStrategy

log = logging.getLogger(__name__)
# RoPE variants whose frequencies transformers recomputes from the largest position of each call, read on the host
# (`dynamic_rope_update`): a CUDA graph cannot capture that read. (longrope's table is made once: its context is
# its short span, spec.context_positions.)
HOST_READ_ROPE = ("dynamic",)


class ModelRunner:
    """Runs prefills, plain decode steps and speculative steps for one engine.

    forward: the rollout forward (the policy's own, or its rollout-precision copy).
    cuda_graphs: replay decode and speculative steps as CUDA graphs (default: on CUDA).
    max_tree_size: cache slots kept past the committed tokens for a verified tree."""

    def __init__(self, forward: LeanForward, *, cuda_graphs: bool | None = None, max_tree_size: int = 64):
        use_graphs = forward.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if use_graphs and forward.device.type != "cuda":
            raise RequestError("cuda_graphs=True needs a model on CUDA")
        rope = getattr(forward.decoder.rotary_emb, "rope_type", "default")
        if use_graphs and any(kind in rope for kind in HOST_READ_ROPE):
            if cuda_graphs:
                raise RequestError(f"cuda_graphs=True cannot capture this model's RoPE (rope_type={rope!r} reads "
                                   f"positions on the host each step): set rollout.cuda_graphs=false")
            log.warning("rope_type=%r reads positions on the host each step, which a CUDA graph cannot capture: "
                        "decoding without CUDA graphs (slower)", rope)
            use_graphs = False
        self.forward = forward
        self.graphs = GraphRunner(forward) if use_graphs else None  # None: every step runs eagerly
        self.max_tree_size = max_tree_size
        self.tree_slots = 0  # slots past the committed tokens that the current cache reserved for a tree
        self.cache: KVCache | None = None
        self.spec_decoder: SpeculativeDecoder | None = None
        self._rebuilds = 0  # speculative steps that rebuilt some row's drafter state from nothing
        # speculative steps that had CUDA graphs yet ran eagerly (no bucket): a benchmark's diagnosis
        self.eager_speculative_steps = 0
        self.batch_rows = BatchRows()  # the running rows' settings and uniforms, while they stay the same
        # graph path: steps appended one step late (`_decode_overlapped`, `_speculative_overlapped`); off: each
        # step waits for its tokens
        self.overlap_steps = True
        self.overlapped_steps = 0  # steps launched from the previous step's results on the device (tests read it)
        self._in_flight: InFlight | None = None  # a plain or a speculative step

    @property
    def max_tree_size(self) -> int:
        return self._max_tree_size

    @max_tree_size.setter
    def max_tree_size(self, value: int) -> None:
        # a float or a string failed later, deep inside the cache allocation, or a bool passed as 1
        if not (is_integer(value) and value >= 0):
            raise RequestError(f"max_tree_size must be an integer >= 0 (cache slots for a verified tree), "
                               f"got {value!r}")
        self._max_tree_size = int(value)

    @property
    def warmups(self) -> int:
        """One-off work the steps have done so far: graphs built (captured) and drafter states rebuilt from
        nothing (a hot-swapped drafter, rows admitted since the last SD step, the first SD step of a rollout).
        A step during which it grows took longer than the arm it ran costs per step: the engine does not time it
        for the speculation policy."""
        return self._rebuilds + (self.graphs.new_graphs if self.graphs is not None else 0)

    @property
    def device(self) -> torch.device:
        return self.forward.device

    @property
    def serving(self) -> SpeculativeDecoder | None:
        """The speculative decoder, once the cache keeps what it drafts from. A drafter attached mid-rollout to
        an engine built without one waits for the next `allocate`: the running rows' cache has no features to
        rebuild its state from and no slots for a tree, so that rollout finishes with plain steps."""
        decoder = self.spec_decoder
        return decoder if decoder is not None and decoder.cache is not None else None

    def set_drafter(self, drafter) -> None:
        """Serve this drafter; the drafter's cache is reset, to be rebuilt from the per-slot features."""
        current = self.spec_decoder
        if isinstance(self._in_flight, SpeculativeInFlight):  # it drafted with the old drafter's state
            self._in_flight.drafter_reset = True
        if current is not None and self.graphs is not None and _same_layout(current.drafter, drafter):
            # Captured graphs read the serving drafter's tensors: load the new weights into them in place.
            current.drafter.load_serving_weights(drafter)
            if current.cache is not None:
                current.cache.lengths.zero_()
            return
        if self.graphs is not None or drafter.fc.weight.dtype != self.forward.dtype:
            drafter = drafter.inference_copy(self.forward)  # the caller's drafter (maybe in training) is untouched
        self.spec_decoder = SpeculativeDecoder(self.forward, drafter.attach(self.forward))
        if current is not None and current.cache is not None:
            self.spec_decoder.cache = current.cache
            current.cache.lengths.zero_()

    def allocate(self, rows: int, length: int) -> KVCache:
        """An empty cache of at least `rows` rows of `length` slots (the old one when it is large enough)."""
        if self.graphs is not None:  # a graph pads the batch to a bucket: its padded rows need cache rows
            rows = batch_bucket(rows, 1 << 30) or rows
        if self.spec_decoder is not None:
            self.tree_slots = self.max_tree_size
            length += self.tree_slots + 1  # a verified tree sits past the committed tokens
        length = cache_capacity(length, graphs=self.graphs is not None)  # attention spans on a grid of 16
        cache = self.cache
        if cache is None or cache.max_rows < rows or cache.max_len < length:
            self.cache = None  # free the old buffers before allocating the new ones
            if self.graphs is not None:
                self.graphs.reset()
            cache = KVCache(self.forward.spec, rows, length, device=self.device, dtype=self.forward.dtype)
            self.cache = cache
        if self.spec_decoder is not None:
            if "tokens" not in cache.slot_data:
                cache.add_slot_data("tokens", dtype=torch.long)
                cache.add_slot_data("features", (self.forward.spec.hidden_size,), dtype=self.forward.dtype)
            self.spec_decoder.allocate(cache.max_rows, cache.max_len)
        cache.lengths.zero_()
        self.batch_rows.release()  # the last rollout's rows
        self._in_flight = None  # a step of a rollout that raised: its sequences are gone
        return cache

    # -- the steps ---------------------------------------------------------------------------------------------

    def prefill(self, groups: list[list[Sequence]], first_row: int) -> list[Sequence]:
        """Prefill each group's prompt once and sample every sequence's first token; returns the sequences in
        the order they occupy rows first_row, first_row + 1, ...: the group leaders (prefilled), then each
        group's siblings in turn, whose rows receive a copy of their leader's prompt KV."""
        self.drain()  # a plain step in flight: its tokens first (the scheduler admits between decode steps)
        with sampler_of(self.forward):
            return self._prefill_and_sample(groups, first_row)

    def _prefill_and_sample(self, groups: list[list[Sequence]], first_row: int) -> list[Sequence]:
        logits = self._prefill([group[0].request.prompt_ids for group in groups], first_row)
        leaders, siblings = [group[0] for group in groups], []
        source = list(range(len(groups)))  # the logits row of each sequence, in row order
        next_row = first_row + len(groups)
        for index, group in enumerate(groups):
            self.cache.copy_prefix(first_row + index, list(range(next_row, next_row + len(group) - 1)))
            next_row += len(group) - 1
            siblings += group[1:]
            source += [index] * (len(group) - 1)
        new = leaders + siblings
        self._sample_into(new, logits[torch.tensor(source, device=logits.device)], admitted=True)
        return new

    def _prefill(self, prompts: list[tuple[int, ...]], first_row: int) -> torch.Tensor:
        """Run each prompt in its own row from first_row on; returns next-token logits [G, V]."""
        lengths = torch.tensor([len(p) for p in prompts])
        ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = torch.tensor(prompt)
        rows = self.cache.rows(first_row, len(prompts))
        rows.lengths.zero_()
        ids = ids.to(self.device, non_blocking=True)  # pageable host sources: see _store_slot_data
        out = self.forward(ids, rows, logits_at=(lengths - 1).to(self.device, non_blocking=True))
        self._store_slot_data(rows, ids, out.hidden)
        rows.advance(lengths)
        if self.serving is not None:  # rows past the running ones start with an empty drafter state
            self.serving.forget_rows(first_row, self.serving.cache.max_rows - first_row)
        return out.logits[:, 0]

    def decode(self, running: list[Sequence], *, overlap: bool = True) -> Landed:
        """One plain decode step: every running sequence gets one token. On the graph path with `overlap_steps`
        and `overlap` (the caller's), its token is appended one step late (`_decode_overlapped`). Returns what
        landed during the call: the tokens appended and the steps they came from."""
        with sampler_of(self.forward):
            if self.graphs is None:
                self._decode_eagerly(running)
                return Landed(len(running), 1)
            if self.overlap_steps and overlap:
                return self._decode_overlapped(running)
            return self.drain() + land_plain(self._launch_decode(running, None))

    def _decode_eagerly(self, running: list[Sequence]) -> None:
        rows = self.cache.rows(0, len(running))
        ids = torch.tensor([[s.tokens[-1]] for s in running])  # host: the forward copies it
        out = self.forward(ids, rows, logits_at="all")
        self._store_slot_data(rows, ids, out.hidden)
        rows.advance(1)
        self._sample_into(running, out.logits[:, 0])

    def _launch_decode(self, running: list[Sequence], previous: "InFlight | None") -> "InFlight":
        """Replay a plain step and start copying what it emits to the host; nothing waits for it. Its input
        tokens are the sequences' last (host), or, when `previous` (the step before, not yet appended) is
        given, that step's tokens where the device left them."""
        rows = self.cache.rows(0, len(running))
        if previous is None:
            ids = torch.tensor([[s.tokens[-1]] for s in running])  # host: the graph's buffer copies it
        else:
            ids = previous.packed[:, :1].long()  # device: copied into the graph's buffer in stream order
            self.overlapped_steps += 1
        settings = self.batch_rows.settings(running)  # host tensors, copied into the graph's buffers
        uniforms = self.batch_rows.uniforms(running, 1)
        # sampled, and the drafter's inputs stored, inside the graph
        packed = self.graphs.decode(ids, rows, settings, uniforms, store_drafter_inputs=self.serving is not None)
        rows.advance(1)
        # copied out before the next replay can overwrite the graph's output (stream order)
        return InFlight(list(running), packed, *copy_to_host(packed))

    def _decode_overlapped(self, running: list[Sequence]) -> Landed:
        """Plain steps one step late (as vLLM's and SGLang's engines overlap their schedulers): step n + 1 is
        launched from step n's tokens on the device before step n's tokens reach the host, so the host's work
        for step n (appending, stop checks, the next step's inputs) runs while the device decodes n + 1. A row
        that stopped at step n got one token too many at n + 1: it is dropped (its uniforms were its own; its
        cache row is retired). The lag ends (the in-flight step is appended: `drain`) before anything else
        touches the rows: a prefill, a speculative step, rows that finished, or a row whose budget the next
        step would pass (its cache has no slot past it)."""
        landed = Landed()
        previous = self._in_flight
        if previous is not None and not (self.continues(running, None) and same_rows(previous.seqs, running)):
            landed += self.drain()
            previous = None
        self._in_flight = None
        launched = self._launch_decode(running, previous)
        if previous is not None:
            landed += land_plain(previous)
        self._in_flight = launched
        if any(s.finish_reason is not None or len(s.tokens) + 1 >= s.request.params.max_new_tokens
               for s in running):
            landed += self.drain()
        return landed

    def drain(self) -> Landed:
        """Append the in-flight step's tokens (if any): afterwards every step taken is in the sequences."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return Landed()
        if isinstance(in_flight, SpeculativeInFlight):
            return land_speculative(in_flight, self.cache.rows(0, len(in_flight.seqs)), self.spec_decoder)
        return land_plain(in_flight)

    def continues(self, running: list[Sequence], strategy: SpecStrategy | None) -> bool:
        """Whether the next step (plain: strategy None) may be launched behind the one in flight, which it then
        lands itself: a plain step behind a plain one, or a speculative step behind one of the same arm over the
        same rows. Otherwise the caller drains first (`drain`)."""
        step = self._in_flight
        if step is None:
            return True
        if not isinstance(step, SpeculativeInFlight):
            return strategy is None
        return (strategy is not None and step.strategy == strategy and not step.drafter_reset
                and same_rows(step.seqs, running) and self.overlap_steps)  # (overlap turned off: drained first)

    def speculative_step(self, running: list[Sequence], strategy: SpecStrategy, *,
                         overlap: bool = False) -> StepTrace:
        """One speculative step (draft → verify → accept → commit): each sequence gets 1 to depth + 1 tokens,
        none past its stop token or budget; a sequence that stopped in the overlapped plain step before it gets
        none (its row is retired after). On the graph path with `overlap_steps` and `overlap` (the caller's), its
        tokens are appended one step late (`_speculative_overlapped`). Its trace has no wall time yet (the
        caller measures the step)."""
        self._check(strategy)
        if overlap and self.overlap_steps and self.graphs is not None:
            trace = self._speculative_overlapped(running, strategy)
            if trace is not None:
                return trace
        self.drain()  # the pending tokens and lengths below are the host's
        rows = self.cache.rows(0, len(running))
        self._count_rebuilds(rows)
        pending = torch.tensor([s.tokens[-1] for s in running])
        settings = self.batch_rows.settings(running)
        uniforms = self.batch_rows.uniforms(running, strategy.uniforms_per_row)
        outcome = None
        with sampler_of(self.forward):
            if self.graphs is not None:  # the whole step as one graph (host inputs are copied into its buffers)
                outcome = self.graphs.speculative_step(self.spec_decoder, rows, pending, settings, uniforms,
                                                       strategy)
            if outcome is None:  # no graph for it (rows not from cache row 0, a batch past the buckets): eager
                self.eager_speculative_steps += self.graphs is not None
                outcome = self.spec_decoder.step(rows, pending.to(self.device), settings.to(self.device),
                                                uniforms.to(self.device), strategy)
        result = outcome.acceptance
        return StepTrace("decode", len(running), append_accepted(running, result), 0.0, mode="sd",
                         strategy=strategy.name, accepted_hist=accepted_hist(result, strategy),
                         draft_s=outcome.draft_s, verify_s=outcome.verify_s)

    def _count_rebuilds(self, rows: CacheRows) -> None:
        seen = self.spec_decoder.draft_rows(rows).lengths  # host: what each row's drafter has been fed
        if bool(((seen == 0) & (rows.lengths > 0)).any()):
            self._rebuilds += 1  # this step feeds that row's drafter its whole context first

    def _speculative_overlapped(self, running: list[Sequence], strategy: SpecStrategy) -> StepTrace | None:
        """Speculative steps one step late, as `_decode_overlapped` does plain ones: step n + 1 is launched from
        step n's results on the device (each row's last token, its committed length), then step n is committed
        and appended on the host while the device runs n + 1. Only behind a step of the same arm over the same
        rows (`continues`), and only while no row can stop in the step left in flight but by a stop token:
        every row's budget leaves room for two more paths (a row past it would need cache slots it has not).
        A row that stopped at step n got step n + 1 too: its tokens are dropped, and the lag ends then. None:
        no graph serves this batch."""
        rows = self.cache.rows(0, len(running))
        if not self.graphs.serves(rows):
            return None
        landed = Landed() if self.continues(running, strategy) else self.drain()
        previous = self._in_flight
        self._in_flight = self._launch_speculative(running, strategy, previous)
        if previous is not None:
            landed += land_speculative(previous, rows, self.spec_decoder)
        if any(s.finish_reason is not None or len(s.tokens) + strategy.depth + 2 > s.request.params.max_new_tokens
               for s in running):
            landed += self.drain()
        hist = merge_hists(landed.accepted_hist, (0,) * (strategy.depth + 1))  # the first call lands none
        return StepTrace("decode", len(running), landed.tokens, 0.0, mode="sd", strategy=strategy.name,
                         accepted_hist=hist, landed=landed.steps)

    def _launch_speculative(self, running: list[Sequence], strategy: SpecStrategy,
                            previous: SpeculativeInFlight | None) -> SpeculativeInFlight:
        """Replay a speculative step and start copying its results to the host; nothing waits for it. It starts
        from the host's state, or from `previous` (launched before it, not yet committed) on the device."""
        rows = self.cache.rows(0, len(running))
        if previous is None:
            self._count_rebuilds(rows)
            pending, start = torch.tensor([s.tokens[-1] for s in running]), None
            committed = rows.lengths.to(self.device, non_blocking=True, copy=True)
        else:  # the host's lengths are where `previous` started: the one before it landed in the last call
            pending, start = previous.following(int(rows.lengths.max()))
            committed = start.committed
            self.overlapped_steps += 1
        settings = self.batch_rows.settings(running)
        uniforms = self.batch_rows.uniforms(running, strategy.uniforms_per_row)
        with sampler_of(self.forward):
            packed = self.graphs.launch_speculative(self.spec_decoder, rows, pending, settings, uniforms, strategy,
                                                    start)
        # copied out before the next replay can overwrite the graph's output (stream order)
        return SpeculativeInFlight(list(running), packed, *copy_to_host(packed), strategy, committed)

    def check_tree_room(self, strategy: SpecStrategy) -> None:
        """A strategy whose tree needs more cache slots past the committed tokens than max_tree_size reserves."""
        if strategy.cache_slots > self.max_tree_size:
            raise RequestError(f"strategy {strategy.name} needs {strategy.cache_slots} cache slots past the committed "
                               f"tokens, more than max_tree_size={self.max_tree_size}; raise max_tree_size")

    def _check(self, strategy: SpecStrategy) -> None:
        needed = strategy.cache_slots
        self.check_tree_room(strategy)
        if needed > self.tree_slots:  # max_tree_size was raised after this rollout's cache was allocated
            raise RequestError(f"strategy {strategy.name} needs {needed} cache slots past the committed tokens, "
                               f"but this rollout reserved {self.tree_slots}: max_tree_size={self.max_tree_size} "
                               f"takes effect at the next generate()")
        check_branching(strategy, self.spec_decoder.drafter)

    def _sample_into(self, seqs: list[Sequence], logits: torch.Tensor, *, admitted: bool = False) -> None:
        """Sample one token per sequence. admitted: a prefill's new sequences, drawn apart from the running rows'
        (whose settings and uniform blocks then carry over into the next step)."""
        if admitted:
            settings = RowSampling.from_params([s.request.params for s in seqs], self.device)
            uniforms = self.batch_rows.uniforms_apart(seqs, 1)
        else:
            settings = self.batch_rows.settings(seqs).to(self.device)
            uniforms = self.batch_rows.uniforms(seqs, 1)
        uniforms = uniforms[:, 0].to(self.device)
        tokens, logprobs = sample_next(logits, settings, uniforms)
        _append(seqs, tokens, logprobs)

    def _store_slot_data(self, rows: CacheRows, ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep token ids and target features of the tokens just written: the drafter is built from them."""
        if self.serving is None:
            return
        # non_blocking: a blocking host-to-device copy waits for the stream (the graph just replayed) to drain.
        # The sources are pageable, so CUDA stages them before the copy call returns (the documented behaviour
        # of cudaMemcpyAsync from pageable memory, and what GraphRunner._fill relies on): advancing the host
        # lengths right after is safe.
        rows.write_drafter_inputs(rows.lengths.to(self.device, non_blocking=True),
                                  ids.to(self.device, non_blocking=True), hidden)

    # -- the rows' state, for the scheduler -------------------------------------------------------------------

    def move_row(self, src: int, dst: int) -> None:
        """Row src's committed state (target KV and slot data, drafter KV) now lives in row dst."""
        self.cache.move_row(src, dst)
        if self.serving is not None:
            self.serving.move_row(src, dst)

    def committed_features(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [T] and target features [T, H] of a row's committed slots [start, end), on the device
        (views: valid until the row is reused)."""
        committed = int(self.cache.lengths[row])
        if end > committed:
            raise AssertionError(f"row {row} holds {committed} committed tokens, expected >= {end}")
        return self.cache.slot_data["tokens"][row, start:end], self.cache.slot_data["features"][row, start:end]


def sampler_of(forward: LeanForward):
    """The draws of `forward`'s steps: with its Triton kernels the fused sampler and the fused draws of a drafter's
    children without replacement, torch's otherwise (`sampling.drawing_with`: set around a step, captured into
    its graph)."""
    if forward.kernels != "triton":
        return drawing_with(None)
    return drawing_with(sample_kernels.sample_from_logprobs,
                        without_replacement=draft_kernels.draw_without_replacement,
                        verify_q_nodes=draft_kernels.verify_q_nodes, expand_frontier=draft_kernels.expand_frontier,
                        follow_q_path=tree_kernels.follow_q_path, tree_mask=tree_kernels.ancestor_mask,
                        commit_path=tree_kernels.commit_path, gather_pairs=tree_kernels.gather_pairs,
                        whole_tree=tree_kernels.whole_tree)


def _append(seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    _append_packed(seqs, pack_tokens(tokens, logprobs))


def _append_packed(seqs: list[Sequence], packed: torch.Tensor) -> None:
    """One device-to-host copy of `pack_tokens`'s [B, 2]: each row's token and log-prob."""
    host = packed.cpu()
    for seq, token, logprob in zip(seqs, host[:, 0].long().tolist(), host[:, 1].float().tolist()):
        seq.append(token, logprob)


def _same_layout(serving, drafter) -> bool:
    """Whether `drafter`'s weights can be loaded into the serving drafter's tensors (same shapes and vocabulary)."""
    theirs, ours = drafter.state_dict(), serving.state_dict()
    if theirs.keys() != ours.keys() or any(theirs[k].shape != ours[k].shape for k in ours):
        return False
    if (serving.draft_to_target is None) != (drafter.draft_to_target is None):
        return False
    return serving.draft_to_target is None or torch.equal(serving.draft_to_target.cpu(), drafter.draft_to_target.cpu())


def check_branching(strategy: SpecStrategy, drafter) -> None:
    """A strategy drafting more children per node than the drafter's vocabulary has tokens."""
    if strategy.branching > drafter.draft_vocab_size:
        raise RequestError(f"strategy {strategy.name} drafts {strategy.branching} children per node, but the "
                           f"drafter's vocabulary has only {drafter.draft_vocab_size} tokens")
