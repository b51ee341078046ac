"""Fused Triton kernels for the speculative step's bookkeeping: the drafter's draws, q-tree acceptance, tree records.

On a GPU a speculative step of a small model is launch-bound like a plain step (docs/benchmarks.md §9: ~2.8 us a
kernel on the H100), and past the verify forward most of its launches were bookkeeping at [B, F, V] or smaller
(S6K2q on the Triton forward: 565 of 842 operations). Each group below is one launch:

- `draw_without_replacement`: a depth's K children per expanded node drawn from q in turn (greedy rows: its
  top-K), by the same two-level float64 inverse CDF as `sampling.sample_from_logprobs` with the earlier draws
  removed (was ~14 operations a depth);
- `verify_q_nodes`: every tree node's recursive rejection sampling over its children in draw order and the draw
  from its last residual, one program a node, the residuals kept implicit through their normalizers (was ~95);
- `expand_frontier`: a drafted depth's K^2 children recorded, the next frontier chosen, what the next pass feeds
  copied into the path buffers, and the chosen nodes' attention rows (was ~13 a depth, then 4 more rows).

The rest of the step's bookkeeping (tree tables, the accepted path, cache writes): `tree_kernels.py`.

A program reads the vocabulary 16 blocks of 256 tokens a step (`sample_kernels.SAMPLE_GROUP`); the CDF's float64 sums
stay per 256-token block, as torch builds them. Off CUDA they run under Triton's interpreter (TRITON_INTERPRET=1),
which is how the CPU tests check them against the torch paths, token for token.
"""

from __future__ import annotations

import torch

from tlt.models.draft_tables import TreeTables
from tlt.models.kernels import _on_device_of, triton
from tlt.models.sample_kernels import SAMPLE_GROUP as GROUP

if triton is not None:
    import triton.language as tl

    from tlt.models.sample_kernels import _draw_in_block, _find_block, _tile_columns

    @triton.jit
    def _remaining_mass(Base, b, VOCAB, drawn, BLOCK: tl.constexpr):
        """One block's probabilities with the tokens already drawn removed, and their float64 sum."""
        cols = b * BLOCK + tl.arange(0, BLOCK)
        logq = tl.load(Base + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
        removed = tl.sum((cols[:, None] == drawn[None, :]).to(tl.int32), 1) > 0
        p = tl.where(removed, 0.0, tl.exp(logq))
        return p, tl.sum(p.to(tl.float64), 0)

    @triton.jit
    def _remaining_tile(Base, t, VOCAB, drawn, KP: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        """Tile t's tokens [GROUP, BLOCK], their log q with the tokens already drawn (and those past the
        vocabulary) at -inf, and their probabilities."""
        cols = _tile_columns(t, GROUP, BLOCK)
        logq = tl.load(Base + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
        slots = tl.arange(0, KP)
        for j in tl.static_range(KP):  # one token at a time: a [GROUP, BLOCK, KP] comparison held every slot
            logq = tl.where(cols == tl.sum(tl.where(slots == j, drawn, 0), 0), float("-inf"), logq)
        return cols, logq, tl.exp(logq)

    @triton.jit
    def _draw_kernel(LogQ, Uniforms, Greedy, Scores, Ids, lq_s, u_sb, u_sf, FRONTIER, VOCAB, BLOCKS, TILES,
                     K: tl.constexpr, KP: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        # one program per expanded node (row b * FRONTIER + f): its K children in turn, GROUP blocks a step
        row = tl.program_id(0).to(tl.int64)
        b = row // FRONTIER
        base = LogQ + row * lq_s
        greedy = tl.load(Greedy + b) != 0
        slots = tl.arange(0, KP)
        drawn = tl.full([KP], -1, tl.int64)  # the tokens drawn so far (-1: none yet)
        shrink = 2.220446049250313e-16       # x * (1 - 2^-52) < x: the torch path's nextafter(x, 0)
        for i in tl.static_range(K):
            if greedy:  # the first index of the largest remaining log q, as torch.argmax
                best = tl.full([], float("-inf"), tl.float32)
                token = tl.zeros([], tl.int64)
                for t in range(0, TILES):
                    cols, logq, _ = _remaining_tile(base, t, VOCAB, drawn, KP, GROUP, BLOCK)
                    top = tl.max(tl.max(logq, 1), 0)
                    first = tl.min(tl.min(tl.where(logq == top, cols, 2147483647), 1), 0)
                    better = top > best
                    token = tl.where(better, first.to(tl.int64), token)
                    best = tl.where(better, top, best)
            else:  # inverse CDF at two levels, as sampling.sample_from_logprobs
                total = tl.zeros([], tl.float64)
                for t in range(0, TILES):
                    _, _, p = _remaining_tile(base, t, VOCAB, drawn, KP, GROUP, BLOCK)
                    total += tl.sum(tl.sum(p.to(tl.float64), 1), 0)
                u = tl.load(Uniforms + b * u_sb + (row % FRONTIER) * u_sf + i).to(tl.float64)
                target = tl.minimum(u * total, total - total * shrink)
                cumulative = tl.zeros([], tl.float64)
                before = tl.zeros([], tl.float64)
                block = tl.zeros([], tl.int32)
                for t in range(0, TILES):
                    _, _, p = _remaining_tile(base, t, VOCAB, drawn, KP, GROUP, BLOCK)
                    cumulative, before, block = _find_block(tl.sum(p.to(tl.float64), 1), cumulative, before,
                                                            block, target)
                block = tl.minimum(block, BLOCKS - 1)
                p, _ = _remaining_mass(base, block, VOCAB, drawn, BLOCK)
                token = _draw_in_block(p, before, target, block, VOCAB, BLOCK)
            # log q of the drawn token; -inf for a token drawn before (a draw made after q ran out of mass)
            again = tl.sum((drawn == token).to(tl.int32), 0) > 0
            score = tl.where(again, float("-inf"), tl.load(base + token).to(tl.float32))
            tl.store(Scores + row * K + i, score.to(Scores.dtype.element_ty))
            tl.store(Ids + row * K + i, token)
            drawn = tl.where(slots == i, token, drawn)


def draw_without_replacement(logq: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor):
    """`q_sampling.draw_without_replacement` in one launch: logq [B, F, V], uniforms [B, F, K], greedy [B] ->
    (log q of each drawn token [B, F, K], -inf for a draw made after q ran out of mass; token ids [B, F, K]).
    The same draws as torch's up to float64 rounding at a token's boundary (its sums run in another order)."""
    batch, frontier, vocab = logq.shape
    k = uniforms.shape[-1]
    logq, greedy = logq.contiguous(), greedy.contiguous()  # the kernel indexes rows b * F + f of [B, F, V]
    if uniforms.stride(-1) != 1:
        uniforms = uniforms.contiguous()
    scores = torch.empty(batch, frontier, k, dtype=logq.dtype, device=logq.device)
    ids = torch.empty(batch, frontier, k, dtype=torch.long, device=logq.device)
    block = 256  # sampling.CDF_BLOCK
    blocks = triton.cdiv(vocab, block)
    with _on_device_of(logq):
        _draw_kernel[(batch * frontier,)](logq, uniforms, greedy, scores, ids, logq.stride(1), uniforms.stride(0),
                                          uniforms.stride(1), frontier, vocab, blocks, triton.cdiv(blocks, GROUP),
                                          K=k, KP=triton.next_power_of_2(k), GROUP=GROUP, BLOCK=block, num_warps=8)
    return scores, ids



if triton is not None:

    @triton.jit
    def _node_q(DraftLogQ, TargetToDraft, cols, inside, slot, HAS_MAP: tl.constexpr):
        """The node's draft probabilities q at target tokens `cols` (0 outside the draft vocabulary, at a leaf)."""
        if HAS_MAP:
            index = tl.load(TargetToDraft + cols, mask=inside, other=-1)
        else:
            index = cols
        ok = (inside & (index >= 0)).to(tl.int32) * (slot >= 0).to(tl.int32) > 0  # (a scalar's & gave an int)
        return tl.where(ok, tl.exp(tl.load(DraftLogQ + index, mask=ok, other=0.0).to(tl.float32)), 0.0)

    @triton.jit
    def _residual_at(p, q, cols, drawn, rejected, mass, kept, J: tl.constexpr, KP: tl.constexpr):
        """r_J and q_J at `cols` from r_0 = p and q_0 = q: after each rejected child j < J, r becomes
        normalize(max(0, r - q)) (r itself when no mass is left) and q loses the child, renormalized; the
        normalizers (mass, kept) of the children before J are given, as `q_sampling._verify_children` has them."""
        slots = tl.arange(0, KP)
        for j in tl.static_range(J):
            pick = slots == j
            was_rejected = tl.sum(tl.where(pick, rejected, 0), 0) > 0
            m = tl.sum(tl.where(pick, mass, 0.0), 0)
            s = tl.sum(tl.where(pick, kept, 0.0), 0)
            c = tl.sum(tl.where(pick, drawn, 0), 0)
            nxt = tl.maximum(p - q, 0.0)
            r_next = tl.where(m > 1e-12, nxt / tl.maximum(m, 1e-30), p)
            q_next = tl.where(cols == c, 0.0, q) / tl.maximum(s, 1e-30)
            p = tl.where(was_rejected, r_next, p)
            q = tl.where(was_rejected, q_next, q)
        return p, q

    @triton.jit
    def _verify_q_nodes_kernel(LogP, DraftLogQ, Slot, TargetToDraft, Children, Tokens, Depths, Uniforms, Greedy,
                               Choice, Final, NODES, lp_s, dq_sb, dq_se, u_s, VOCAB, BLOCKS, TILES,
                               K: tl.constexpr, KP: tl.constexpr, HAS_MAP: tl.constexpr, GROUP: tl.constexpr,
                               BLOCK: tl.constexpr):
        # one program per tree node (row b * NODES + n): recursive rejection sampling over its children in draw
        # order, then, when none was accepted, the draw from the last residual
        row = tl.program_id(0).to(tl.int64)
        b = row // NODES
        base = LogP + row * lp_s
        slot = tl.load(Slot + row)
        dq = DraftLogQ + b * dq_sb + tl.maximum(slot, 0) * dq_se
        greedy = tl.load(Greedy + b) != 0
        coins = Uniforms + b * u_s + tl.load(Depths + row) * (K + 1)
        slots = tl.arange(0, KP)
        children = tl.load(Children + row * K + slots, mask=slots < K, other=-1)
        child_tokens = tl.load(Tokens + b * NODES + tl.maximum(children, 0), mask=slots < K, other=0)
        argmax = tl.zeros([], tl.int64)
        if greedy:  # the first index of the largest target log-prob, as torch.argmax
            best = tl.full([], float("-inf"), tl.float32)
            for t in range(0, TILES):
                cols = _tile_columns(t, GROUP, BLOCK)
                lp = tl.load(base + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
                top = tl.max(tl.max(lp, 1), 0)
                first = tl.min(tl.min(tl.where(lp == top, cols, 2147483647), 1), 0)
                better = top > best
                argmax = tl.where(better, first.to(tl.int64), argmax)
                best = tl.where(better, top, best)
        choice = tl.full([], -1, tl.int32)
        rejected = tl.zeros([KP], tl.int32)
        mass = tl.zeros([KP], tl.float32)
        kept = tl.zeros([KP], tl.float32)
        for i in tl.static_range(K):
            pick = slots == i
            c = tl.sum(tl.where(pick, child_tokens, 0), 0)
            valid = tl.max(tl.where(pick, children, -1), 0) >= 0
            one = c + tl.zeros([1], tl.int64)
            p_c = tl.exp(tl.load(base + one).to(tl.float32))
            q_c = _node_q(dq, TargetToDraft, one, one >= 0, slot, HAS_MAP)
            r_c, q_c = _residual_at(p_c, q_c, one, child_tokens, rejected, mass, kept, i, KP)
            r_c = tl.sum(r_c, 0)
            q_c = tl.sum(q_c, 0)
            open_ = valid & (choice < 0)
            u = 1.0 - tl.load(coins + i).to(tl.float32)
            drawn = open_ & (q_c > 0)
            hit = tl.where(greedy, open_ & (c == argmax), drawn & (u * q_c <= r_c))
            choice = tl.where(hit, i, choice)
            if drawn & ~hit & ~greedy:  # the residual and q after this rejected child
                m = tl.zeros([], tl.float32)
                s = tl.zeros([], tl.float32)
                for t in range(0, TILES):
                    cols = _tile_columns(t, GROUP, BLOCK)
                    inside = cols < VOCAB
                    p = tl.where(inside, tl.exp(tl.load(base + cols, mask=inside, other=float("-inf"))
                                                .to(tl.float32)), 0.0)
                    r, q = _residual_at(p, _node_q(dq, TargetToDraft, cols, inside, slot, HAS_MAP), cols,
                                        child_tokens, rejected, mass, kept, i, KP)
                    m += tl.sum(tl.sum(tl.maximum(r - q, 0.0), 1), 0)
                    s += tl.sum(tl.sum(tl.where(cols == c, 0.0, q), 1), 0)
                rejected = tl.where(pick, 1, rejected)
                mass = tl.where(pick, m, mass)
                kept = tl.where(pick, s, kept)
        final = argmax
        if (choice < 0) & ~greedy:  # the residual's sample, as sample_from_logprobs(residual.log(), u)
            total = tl.zeros([], tl.float64)
            for t in range(0, TILES):
                p = _final_probs(base, dq, TargetToDraft, _tile_columns(t, GROUP, BLOCK), VOCAB, slot,
                                 child_tokens, rejected, mass, kept, K, KP, HAS_MAP)
                total += tl.sum(tl.sum(p.to(tl.float64), 1), 0)
            shrink = 2.220446049250313e-16
            target = tl.minimum(tl.load(coins + K).to(tl.float64) * total, total - total * shrink)
            cumulative = tl.zeros([], tl.float64)
            before = tl.zeros([], tl.float64)
            block = tl.zeros([], tl.int32)
            for t in range(0, TILES):
                p = _final_probs(base, dq, TargetToDraft, _tile_columns(t, GROUP, BLOCK), VOCAB, slot,
                                 child_tokens, rejected, mass, kept, K, KP, HAS_MAP)
                cumulative, before, block = _find_block(tl.sum(p.to(tl.float64), 1), cumulative, before, block,
                                                        target)
            block = tl.minimum(block, BLOCKS - 1)
            p = _final_probs(base, dq, TargetToDraft, block * BLOCK + tl.arange(0, BLOCK), VOCAB, slot,
                             child_tokens, rejected, mass, kept, K, KP, HAS_MAP)
            final = _draw_in_block(p, before, target, block, VOCAB, BLOCK)
        tl.store(Choice + row, choice.to(tl.int64))
        tl.store(Final + row, final)

    @triton.jit
    def _final_probs(base, dq, TargetToDraft, cols, VOCAB, slot, child_tokens, rejected, mass, kept,
                     K: tl.constexpr, KP: tl.constexpr, HAS_MAP: tl.constexpr):
        """exp(log r_K) at tokens `cols` (a block or a tile): the residual after every rejected child, through a
        log as the torch path samples it (`sample_from_logprobs(residual.log(), ...)`)."""
        inside = cols < VOCAB
        p = tl.where(inside, tl.exp(tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)), 0.0)
        r, _ = _residual_at(p, _node_q(dq, TargetToDraft, cols, inside, slot, HAS_MAP), cols, child_tokens,
                            rejected, mass, kept, K, KP)
        positive = inside & (r > 0)  # log(0) = -inf, exp(-inf) = 0: zeros stay zeros without a log of 0
        return tl.where(positive, tl.exp(tl.log(tl.where(positive, r, 1.0))), 0.0)


def verify_q_nodes(logprobs: torch.Tensor, dists: torch.Tensor, slot: torch.Tensor,
                   target_to_draft: torch.Tensor | None, children: torch.Tensor, tokens: torch.Tensor,
                   depths: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor):
    """Every tree node's recursive rejection sampling in one launch (`q_sampling._verify_children` and the final
    draw of `_accept_q_every_node`): logprobs [B, N + 1, V] the target's processed log-probs, dists [B, E, Vd]
    the drafts' log q, slot [B, N + 1] a node's row in dists (-1: a leaf), target_to_draft [V] (-1 outside the
    draft vocabulary; None: they are one), children [B, N + 1, K], tokens [B, N + 1], depths [B, N + 1],
    uniforms [B, (S + 1)(K + 1) + ...] (a node reads its depth's K + 1), greedy [B]. Returns (the accepted child's
    position, -1 for none [B, N + 1]; the node's final token [B, N + 1]: its argmax for a greedy row, else a
    sample of the last residual where no child was accepted, else 0)."""
    batch, nodes, vocab = logprobs.shape
    k = children.shape[-1]
    expected = vocab if target_to_draft is None else target_to_draft.shape[0]
    if (target_to_draft is None and dists.shape[-1] != vocab) or expected != vocab:
        raise ValueError(f"verify_q_nodes: q over {dists.shape[-1]} tokens needs target_to_draft of the target's "
                         f"{vocab} (got {None if target_to_draft is None else tuple(target_to_draft.shape)})")
    logprobs, greedy = logprobs.contiguous(), greedy.contiguous()  # rows b * (N + 1) + n of [B, N + 1, V]
    dists = dists if dists.stride(-1) == 1 else dists.contiguous()
    uniforms = uniforms if uniforms.stride(-1) == 1 else uniforms.contiguous()
    slot, children, tokens, depths = (t.contiguous() for t in (slot, children, tokens, depths))
    choice = torch.empty(batch, nodes, dtype=torch.long, device=logprobs.device)
    final = torch.empty(batch, nodes, dtype=torch.long, device=logprobs.device)
    block = 256
    blocks = triton.cdiv(vocab, block)
    mapping = target_to_draft if target_to_draft is not None else slot  # any pointer: unread without a map
    with _on_device_of(logprobs):
        _verify_q_nodes_kernel[(batch * nodes,)](
            logprobs, dists, slot, mapping, children, tokens, depths, uniforms, greedy, choice, final, nodes,
            logprobs.stride(1), dists.stride(0), dists.stride(1), uniforms.stride(0), vocab, blocks,
            triton.cdiv(blocks, GROUP), K=k, KP=triton.next_power_of_2(k), HAS_MAP=target_to_draft is not None,
            GROUP=GROUP, BLOCK=block, num_warps=8)
    return choice, final


if triton is not None:

    @triton.jit
    def _expand_frontier_kernel(Tokens, Scores, Parents, PathTokens, PathFeatures, Frontier, ChildScores,
                                ChildTokens, Hidden, NewFrontier, FrontierParent, Bias, NodeSlots, COUNT, FED,
                                HIDDEN, first, feed_at, h_sb, h_sk, b_sb, b_sr, s_sb, WIDTH, K: tl.constexpr,
                                KK: tl.constexpr, FEED: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                                BLOCK_S: tl.constexpr):
        # one program per row: the K^2 children of the frontier recorded, the K best chosen (ties to the earlier
        # candidate, as a stable sort), and what the next pass feeds copied into the path buffers, with (ROWS)
        # each chosen node's attention row: its parent's, and its own slot
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, KK)
        valid = offs < K * K
        parent = tl.load(Frontier + b * K + offs // K, mask=valid, other=0)
        total = tl.load(Scores + b * COUNT + parent, mask=valid, other=0.0) + \
            tl.load(ChildScores + b * K * K + offs, mask=valid, other=0.0)
        token = tl.load(ChildTokens + b * K * K + offs, mask=valid, other=0)
        tl.store(Scores + b * COUNT + first + offs, total, mask=valid)
        tl.store(Tokens + b * COUNT + first + offs, token, mask=valid)
        tl.store(Parents + b * COUNT + first + offs, parent, mask=valid)
        left = tl.where(valid, total, float("-inf"))
        taken = offs < 0  # all False
        cols = tl.arange(0, BLOCK_H)
        for j in tl.static_range(K):
            top = tl.max(tl.where(taken, float("-inf"), left), 0)
            # the first candidate not taken whose score is the top (a -inf top: the first not taken)
            best = tl.min(tl.where(valid & ~taken & (left == top), offs, KK), 0)
            best = tl.where(best < KK, best, tl.min(tl.where(valid & ~taken, offs, KK), 0))
            taken = taken | (offs == best)
            tl.store(NewFrontier + b * K + j, (first + best).to(tl.int64))
            tl.store(FrontierParent + b * K + j, (best // K).to(tl.int64))
            if FEED:
                tl.store(PathTokens + b * FED + feed_at + j, tl.sum(tl.where(offs == best, token, 0), 0))
                source = Hidden + b * h_sb + (best // K) * h_sk
                target = PathFeatures + (b * FED + feed_at + j) * HIDDEN
                for h in range(0, HIDDEN, BLOCK_H):
                    inside = h + cols < HIDDEN
                    tl.store(target + h + cols, tl.load(source + h + cols, mask=inside), mask=inside)
                if ROWS:  # the parent's row is K rows back (`TreeTables.add_nodes`), written by an earlier launch
                    row = Bias + b * b_sb + (feed_at - K + best // K) * b_sr
                    node_row = Bias + b * b_sb + (feed_at + j) * b_sr
                    own = tl.load(NodeSlots + b * s_sb + feed_at + j)
                    for s0 in range(0, WIDTH, BLOCK_S):
                        span = s0 + tl.arange(0, BLOCK_S)
                        seen = tl.load(row + span, mask=span < WIDTH)
                        tl.store(node_row + span, tl.where(span == own, 0.0, seen).to(Bias.dtype.element_ty),
                                 mask=span < WIDTH)


def expand_frontier(tokens, scores, parents, path_tokens, path_features, frontier, child_scores, child_tokens,
                    hidden, first: int, feed_at: int | None, tables=None):
    """`tree._expand_frontier` in one launch: records the K^2 children of a drafted depth in the candidate
    buffers (tokens, scores, parents [B, C], written in place), picks the next frontier (the K best, ties to
    the earlier candidate) and copies its tokens and its parents' features [B, K, H] into the path buffers at
    column feed_at (None: the last depth), and its attention rows into a `TreeTables`' bias (other tables get
    `add_nodes`). Returns (frontier, frontier_parent) [B, K] each."""
    batch, k, _ = child_scores.shape
    for name, t in (("tokens", tokens), ("scores", scores), ("parents", parents), ("path_tokens", path_tokens),
                    ("path_features", path_features)):
        if not t.is_contiguous():
            raise ValueError(f"expand_frontier writes {name} in place: it must be contiguous")
    frontier, child_scores, child_tokens = (t.contiguous() for t in (frontier, child_scores, child_tokens))
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    new_frontier = torch.empty(batch, k, dtype=torch.long, device=tokens.device)
    frontier_parent = torch.empty(batch, k, dtype=torch.long, device=tokens.device)
    hidden_size = path_features.shape[-1]
    rows = feed_at is not None and isinstance(tables, TreeTables)
    bias, node_slots = (tables.bias, tables.slots) if rows else (scores, frontier)  # (placeholders: unread)
    if rows and (bias.stride(-1) != 1 or node_slots.stride(-1) != 1):
        raise ValueError("expand_frontier: the tree tables' bias and slots must be contiguous in their last dim")
    with _on_device_of(tokens):
        _expand_frontier_kernel[(batch,)](
            tokens, scores, parents, path_tokens, path_features, frontier, child_scores.to(scores.dtype),
            child_tokens, hidden, new_frontier, frontier_parent, bias, node_slots, tokens.shape[1],
            path_tokens.shape[1], hidden_size, first, 0 if feed_at is None else feed_at, hidden.stride(0),
            hidden.stride(1), bias.stride(0), bias.stride(1) if rows else 0, node_slots.stride(0),
            bias.shape[-1] if rows else 0, K=k, KK=triton.next_power_of_2(k * k), FEED=feed_at is not None,
            ROWS=rows, BLOCK_H=min(1024, triton.next_power_of_2(hidden_size)),
            BLOCK_S=min(1024, triton.next_power_of_2(bias.shape[-1])) if rows else 16, num_warps=4)
    if feed_at is not None and tables is not None and not rows:
        tables.add_nodes(feed_at, k, frontier_parent)
    return new_frontier, frontier_parent
