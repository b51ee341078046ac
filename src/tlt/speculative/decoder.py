"""One speculative decode step over the running rows: draft → verify → accept → commit.

The target cache keeps, per committed slot, the token id and the target's hidden state ("tokens", "features"
slot data), so the drafter's own one-layer cache can be (re)built from them at any time — switching
speculation on mid-rollout never re-prefills the target.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tlt.models.eagle import EagleDrafter
from tlt.models.kv_cache import CacheRows, KVCache
from tlt.models.lean_forward import LeanForward
from tlt.rollout.sampling import RowSampling, processed_logprobs
from tlt.speculative.acceptance import Acceptance, accept
from tlt.speculative.q_sampling import DraftDistributions, accept_q, sampling_pick
from tlt.speculative.strategy import SpecStrategy
from tlt.speculative.tree import draft_tree, select_tree


@dataclass
class SpecOutcome:
    acceptance: Acceptance
    draft_s: float
    verify_s: float


class SpeculativeDecoder:
    def __init__(self, target: LeanForward, drafter: EagleDrafter):
        self.target = target
        self.drafter = drafter
        self.cache: KVCache | None = None
        # Tests swap in biased rules to show that the losslessness tests can fail.
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

    # the step -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, target_rows: CacheRows, pending: torch.Tensor, settings: RowSampling, uniforms: torch.Tensor,
             strategy: SpecStrategy) -> SpecOutcome:
        started = time.perf_counter()
        draft_rows = self.cache.rows(target_rows.start, target_rows.count)
        root_hidden = self._catch_up(target_rows, draft_rows, pending)
        positions = draft_rows.lengths.clone()
        if strategy.rule == "q":
            draft_draws, uniforms = uniforms[:, :strategy.tree_size], uniforms[:, strategy.tree_size:]
            pick = sampling_pick(settings, draft_draws.to(pending.device))
            candidates = draft_tree(self.drafter, root_hidden, draft_rows, positions, strategy, pick)
        else:
            candidates = draft_tree(self.drafter, root_hidden, draft_rows, positions, strategy)
        tree = select_tree(pending, candidates, strategy)
        drafted = time.perf_counter()
        committed = target_rows.lengths.to(pending.device)
        out = self.target(tree.tokens, target_rows, positions=committed[:, None] + tree.depths,
                          new_token_mask=tree.attention(), logits_at="all")
        logprobs = processed_logprobs(out.logits, settings)
        if strategy.rule == "q":
            drafts = DraftDistributions.from_candidates(candidates, tree.size + 1)
            acceptance = accept_q(tree, logprobs, drafts, self.drafter.draft_to_target, settings.greedy, uniforms,
                                  accept_rule=self.q_accept_rule, residual_rule=self.q_residual_rule)
        else:
            acceptance = accept(tree, logprobs, settings.greedy, uniforms, accept_rule=self.accept_rule)
        slots = committed[:, None] + torch.arange(tree.tokens.shape[1], device=pending.device)[None, :]
        target_rows.write_slots("tokens", slots, tree.tokens)
        target_rows.write_slots("features", slots, out.hidden)
        target_rows.keep(acceptance.path.clamp(min=0), acceptance.accepted + 1)  # root + accepted path
        return SpecOutcome(acceptance, drafted - started, time.perf_counter() - drafted)

    def _catch_up(self, target_rows: CacheRows, draft_rows: CacheRows, pending: torch.Tensor) -> torch.Tensor:
        """Feed the drafter every committed pair it has not seen: pair i is (x_{i+1}, f_i), the last one uses
        the pending token. Returns its output at the last pair [B, H] (the root of this step's tree)."""
        device = pending.device
        committed = target_rows.lengths.to(device)
        seen = draft_rows.lengths.to(device)
        missing = committed - seen                                                  # >= 1 per row
        width = int(missing.max())
        pair = seen[:, None] + torch.arange(width, device=device)[None, :]           # [B, M] pair index i
        features = target_rows.slots("features")
        limit = features.shape[1] - 1  # pairs past a row's `missing` are padding: clamp their reads
        next_slot = (pair + 1).clamp(max=limit)
        tokens = target_rows.slots("tokens").gather(1, next_slot)
        tokens = torch.where(pair + 1 == committed[:, None], pending[:, None], tokens)
        features = features.gather(1, pair.clamp(max=limit)[:, :, None].expand(-1, -1, features.shape[-1]))
        hidden = self.drafter.step(tokens, features, draft_rows, pair)
        draft_rows.advance(missing)
        return hidden[torch.arange(hidden.shape[0], device=device), missing - 1]
