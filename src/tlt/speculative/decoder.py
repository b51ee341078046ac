"""One speculative decode step over the running rows: catch up → draft → verify → accept → commit.

The target cache keeps, per committed slot, the token id and the target's hidden state ("tokens", "features"
slot data), so the drafter's own one-layer cache can be (re)built from them at any time — switching
speculation on mid-rollout never re-prefills the target.

The step is split so that a CUDA graph can replay its device part (`run`) unchanged: `run` reads only device
tensors of fixed shapes (`StepInputs`, sized by a host-side `StepShape`) and never reads a device value on the
host when `sync_free` is set; `finish` is the one host transfer per step (emitted tokens, log-probs, accepted
counts) and advances the host-side lengths of both caches. The eager `step` is the same three calls with
exact shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tlt.models.eagle import EagleDrafter
from tlt.models.kv_cache import CacheRows, KVCache
from tlt.models.lean_forward import LeanForward
from tlt.sampling import RowSampling, fused_draws, processed_logprobs
from tlt.speculative.acceptance import Acceptance, accept
from tlt.speculative.chain_acceptance import accept_chain, accept_q_chain
from tlt.speculative.q_sampling import DraftDistributions, accept_q, sampling_pick
from tlt.speculative.strategy import SpecStrategy
from tlt.speculative.tree import DraftTree, draft_tree, select_tree


@dataclass
class StepInputs:
    """A step's inputs on the device, one entry per row (a graph's rows include its padding rows)."""

    pending: torch.Tensor      # [B] the last sampled token, not yet in the target cache
    committed: torch.Tensor    # [B] the target cache's committed lengths
    seen: torch.Tensor         # [B] the drafter cache's committed pairs (<= committed)
    settings: RowSampling
    uniforms: torch.Tensor     # [B, strategy.uniforms_per_row]


@dataclass(frozen=True)
class StepShape:
    """What fixes a step's tensor shapes (host ints): a graph is captured per distinct shape.

    width: drafter catch-up pairs per row (>= every row's committed - seen); target_kv / draft_kv: the
    attention spans of the verify forward and of the drafter's passes (rows' lengths are masked inside)."""

    strategy: SpecStrategy
    width: int
    target_kv: int
    draft_kv: int

    @classmethod
    def exact(cls, strategy: SpecStrategy, committed: torch.Tensor, seen: torch.Tensor) -> "StepShape":
        """The tightest shape for host lengths committed, seen [B] (eager steps)."""
        width = int((committed - seen).max())
        return cls(strategy, width, *spans(strategy, int(committed.max()), int(seen.max()), width))


def spans(strategy: SpecStrategy, longest: int, most_seen: int, width: int) -> tuple[int, int]:
    """(target_kv, draft_kv) needed by rows whose longest committed length is `longest`: the verified tree
    sits past the committed tokens; the drafter writes its catch-up past `seen` and its frontier nodes past
    the committed pairs."""
    draft_nodes = (strategy.depth - 1) * strategy.branching
    return longest + strategy.tree_size + 1, max(most_seen + width, longest + draft_nodes)


@dataclass
class SpecOutcome:
    acceptance: Acceptance  # host tensors
    draft_s: float          # 0 when the step ran as one graph (the two halves are not timed apart)
    verify_s: float


class SpeculativeDecoder:
    def __init__(self, target: LeanForward, drafter: EagleDrafter):
        self.target = target
        self.drafter = drafter
        self.cache: KVCache | None = None
        # Tests swap in biased rules to show that the losslessness tests can fail (read when a graph is captured).
        self.accept_rule = None       # target-only rule
        self.q_accept_rule = None     # q-sampling: acceptance test
        self.q_residual_rule = None   # q-sampling: residual after a rejected child

    def allocate(self, rows: int, length: int) -> None:
        """A drafter cache for `rows` rows of a target cache of `length` slots.

        Twice the target's length: a catch-up writes max(missing) pairs to every row at seen + t, so a row
        admitted mid-rollout (missing = its whole prompt) beside a row near the end of its budget (seen close
        to `length`) writes up to 2 * length slots; the padded writes are never committed. One layer, so the
        headroom costs 2 / num_layers of the target cache."""
        length = 2 * length
        if self.cache is None or self.cache.max_rows < rows or self.cache.max_len < length:
            self.cache = None
            self.cache = self.drafter.new_cache(rows, length)
        self.cache.lengths.zero_()

    # row bookkeeping mirrors the target cache's -----------------------------------------------------------

    def forget_rows(self, start: int, count: int) -> None:
        """New rows start with an empty drafter state; it is rebuilt from the target's slot data when needed."""
        self.cache.lengths[start:start + count] = 0

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)

    # the eager step -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, target_rows: CacheRows, pending: torch.Tensor, settings: RowSampling, uniforms: torch.Tensor,
             strategy: SpecStrategy) -> SpecOutcome:
        """One step with exact shapes; pending [B] and uniforms on the device."""
        started = time.perf_counter()
        draft_rows = self.draft_rows(target_rows)
        shape = StepShape.exact(strategy, target_rows.lengths, draft_rows.lengths)
        inputs = self.inputs(target_rows, draft_rows, pending, settings, uniforms)
        tree, drafts = self.draft(target_rows, draft_rows, inputs, shape)
        drafted = time.perf_counter()
        acceptance = self.verify(target_rows, inputs, shape, tree, drafts, sync_free=False)
        result = self.finish(target_rows, draft_rows, pack(acceptance))
        return SpecOutcome(result, drafted - started, time.perf_counter() - drafted)

    def draft_rows(self, target_rows: CacheRows) -> CacheRows:
        return self.cache.rows(target_rows.start, target_rows.count)

    def inputs(self, target_rows: CacheRows, draft_rows: CacheRows, pending, settings, uniforms) -> StepInputs:
        device = pending.device
        return StepInputs(pending, target_rows.lengths.to(device), draft_rows.lengths.to(device), settings, uniforms)

    # the device part: what a CUDA graph replays -----------------------------------------------------------

    def run(self, target_rows: CacheRows, draft_rows: CacheRows, inputs: StepInputs, shape: StepShape, *,
            sync_free: bool = True) -> torch.Tensor:
        """Draft, verify and accept on the device; returns `pack(acceptance)`. Reads only `inputs` (device)
        and host ints of `shape`: the KV writes and the accepted path's move are done, the host lengths not."""
        tree, drafts = self.draft(target_rows, draft_rows, inputs, shape)
        return pack(self.verify(target_rows, inputs, shape, tree, drafts, sync_free=sync_free))

    def draft(self, target_rows: CacheRows, draft_rows: CacheRows, inputs: StepInputs, shape: StepShape):
        """Catch the drafter up on every committed pair, then grow and select the tree: (tree, q or None)."""
        strategy = shape.strategy
        root_hidden = self.feed_pairs(target_rows, draft_rows, inputs.pending, inputs.committed, inputs.seen,
                                      inputs.committed, shape.width, shape.draft_kv)
        if strategy.rule == "q":
            pick = sampling_pick(inputs.settings, inputs.uniforms[:, :strategy.tree_size])
            candidates = draft_tree(self.drafter, root_hidden, draft_rows, inputs.committed, strategy, pick,
                                    kv_len=shape.draft_kv)
            drafts = DraftDistributions.from_candidates(candidates, strategy.tree_size + 1)
        else:
            candidates = draft_tree(self.drafter, root_hidden, draft_rows, inputs.committed, strategy,
                                    kv_len=shape.draft_kv)
            drafts = None
        return select_tree(inputs.pending, candidates, strategy), drafts

    def verify(self, target_rows: CacheRows, inputs: StepInputs, shape: StepShape, tree: DraftTree,
               drafts: DraftDistributions | None, *, sync_free: bool) -> Acceptance:
        """The target scores the whole tree in one forward; the rule accepts a path; the path's KV, tokens and
        features move to the front of the written block (the host lengths advance in `finish`)."""
        committed, settings = inputs.committed, inputs.settings
        out = self.target.run(tree.tokens, target_rows, committed, positions=committed[:, None] + tree.depths,
                              new_token_mask=tree.attention(), logits_at="all", kv_len=shape.target_kv)
        logprobs = processed_logprobs(out.logits, settings)
        chain = shape.strategy.branching == 1  # every depth at once: a fraction of the walk's operations
        if drafts is not None:
            uniforms = inputs.uniforms[:, shape.strategy.tree_size:]
            rules = dict(accept_rule=self.q_accept_rule, residual_rule=self.q_residual_rule)
            # a chain's own fast path, unless one launch tests every node (Triton kernels, a graph's step)
            fused = sync_free and fused_draws().verify_q_nodes is not None and not any(rules.values())
            acceptance = accept_q_chain(tree, logprobs, drafts, self.drafter.draft_to_target, settings.greedy,
                                        uniforms, **rules) if chain and not fused else \
                accept_q(tree, logprobs, drafts, self.drafter.draft_to_target, settings.greedy, uniforms, **rules,
                         sync_free=sync_free, target_to_draft=self.drafter.target_to_draft())
        elif chain:
            acceptance = accept_chain(tree, logprobs, settings.greedy, inputs.uniforms, accept_rule=self.accept_rule)
        else:
            acceptance = accept(tree, logprobs, settings.greedy, inputs.uniforms, accept_rule=self.accept_rule,
                                sync_free=sync_free)
        moves = shape.strategy.branching > 1  # a chain's accepted path is its first nodes, already in place
        commit = fused_draws().commit_path
        if commit is not None:  # one launch (Triton kernels)
            commit(target_rows, committed, tree.tokens, out.hidden, acceptance.path if moves else None,
                   acceptance.emitted if moves else None)
            return acceptance
        slots = committed[:, None] + torch.arange(tree.tokens.shape[1], device=committed.device)[None, :]
        target_rows.write_slots("tokens", slots, tree.tokens)
        target_rows.write_slots("features", slots, out.hidden)
        if moves:
            target_rows.gather_written(committed, acceptance.path.clamp(min=0), acceptance.emitted)
        return acceptance

    def feed_pairs(self, target_rows: CacheRows, draft_rows: CacheRows, pending: torch.Tensor,
                   committed: torch.Tensor, seen: torch.Tensor, until: torch.Tensor, width: int,
                   draft_kv: int) -> torch.Tensor:
        """Feed the drafter pairs [seen, until) of every row (device [B]; until - seen <= width, padded to
        width): pair i is (x_{i+1}, f_i), and x_committed is the pending token. Writes the drafter's KV (the
        caller commits it); returns the drafter's output at pair until - 1 [B, H] (this step's tree root)."""
        device = pending.device
        pair = seen[:, None] + torch.arange(width, device=device)[None, :]           # [B, W] pair index i
        fused = fused_draws().gather_pairs
        if fused is not None:  # one launch (Triton kernels)
            tokens, features, last = fused(target_rows.slots("tokens"), target_rows.slots("features"), pending,
                                           committed, seen, until, width)
        else:
            tokens, features, last = _pairs(target_rows, pending, committed, seen, until, pair)
        hidden = self.drafter.step(tokens, features, draft_rows, pair, lengths=seen, kv_len=draft_kv)
        return hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]

    # the host part ---------------------------------------------------------------------------------------------

    def bring_within(self, target_rows: CacheRows, width: int) -> None:
        """Eagerly feed the drafter all but each row's last missing pair when some row misses more than
        `width` (speculation switched on mid-rollout, a row just admitted, a hot-swapped drafter), so that a
        step of catch-up width `width` serves every row. Reads host lengths only: free when nothing is missing."""
        draft_rows = self.draft_rows(target_rows)
        committed, seen = target_rows.lengths, draft_rows.lengths
        missing = committed - seen
        if int(missing.max()) <= width:
            return
        upto = (missing - 1).clamp(min=0)
        bulk = int(upto.max())
        device = self.cache.device
        # Pairs before the last one read their next token from the cache: the pending token is never needed.
        unused_pending = torch.zeros(target_rows.count, dtype=torch.long, device=device)
        copy = dict(device=device, non_blocking=True)  # host lengths: pageable, staged before the call returns
        self.feed_pairs(target_rows, draft_rows, unused_pending, committed.to(**copy), seen.to(**copy),
                        (seen + upto).to(**copy), bulk, int(seen.max()) + bulk)
        draft_rows.advance(upto)

    def finish(self, target_rows: CacheRows, draft_rows: CacheRows, packed: torch.Tensor) -> Acceptance:
        """The step's one device-to-host transfer; commits the accepted path (target) and the caught-up pairs
        (drafter) on the host lengths. packed: `pack(...)` for these rows (a graph's may have more rows)."""
        return self.commit(target_rows, draft_rows, unpack(packed[:target_rows.count].cpu()))

    @staticmethod
    def commit(target_rows: CacheRows, draft_rows: CacheRows, acceptance: Acceptance, *,
               drafter_fed: bool = True) -> Acceptance:
        """Advance the host lengths past a finished step: the accepted path (target) and the caught-up pairs
        (drafter; drafter_fed=False: its state was reset since the step was launched, and is rebuilt)."""
        if drafter_fed:
            draft_rows.lengths.copy_(target_rows.lengths)  # the drafter has now seen every committed pair
        target_rows.advance(acceptance.emitted)            # root + accepted path
        return acceptance


def _pairs(target_rows: CacheRows, pending, committed, seen, until, pair):
    """`feed_pairs`' inputs: pair i is (x_{i+1}, f_i) of the slot data, x_committed the pending token, and the
    index of each row's last pair (`tree_kernels.gather_pairs` in one launch)."""
    features = target_rows.slots("features")
    limit = features.shape[1] - 1  # pairs past a row's `until` are padding: clamp their reads
    tokens = target_rows.slots("tokens").gather(1, (pair + 1).clamp(max=limit))
    tokens = torch.where(pair + 1 == committed[:, None], pending[:, None], tokens)
    features = features.gather(1, pair.clamp(max=limit)[:, :, None].expand(-1, -1, features.shape[-1]))
    return tokens, features, (until - seen - 1).clamp(min=0)


def pack(acceptance: Acceptance) -> torch.Tensor:
    """[B, 3 * (S + 2) + 1] float64: tokens, log-probs, path, accepted — one tensor, one transfer (ids < 2^53)."""
    if acceptance.packed is not None:
        return acceptance.packed
    return torch.cat([acceptance.tokens.double(), acceptance.logprobs.double(), acceptance.path.double(),
                      acceptance.accepted.double()[:, None]], 1)


def unpack(packed: torch.Tensor) -> Acceptance:
    width = (packed.shape[1] - 1) // 3
    tokens, logprobs, path = packed[:, :width], packed[:, width:2 * width], packed[:, 2 * width:3 * width]
    accepted = packed[:, -1].long()
    return Acceptance(path.long(), accepted, tokens.long(), logprobs.float(), accepted + 1)
