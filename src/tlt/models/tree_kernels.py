"""Fused Triton kernels for the speculative step's tree tables, its accepted path and its cache writes.

The rest of an SD step's bookkeeping after `draft_kernels.py`'s draws, node tests and frontier records (eighth
session, 2026-11-27): on a GPU the step is launch-bound, and each group below was a dozen or more small torch
operations. Each is one launch, set with the sampler through `sampling.drawing_with` (`FusedDraws`):

- `whole_tree`: a tree that keeps every candidate, its expansions, children and parents (was ~12 operations);
- `gather_pairs`: the drafter's catch-up inputs, pair tokens with the pending token and features (~13);
- `commit_path`: every node's token and feature into the slot data, the accepted path moved to the front of the
  written block in every layer's K and V (~19);
- `ancestor_mask`: a tree's verify mask (~14);
- `follow_q_path`: the walk along a q tree's accepted children, packed for the host too (~35).

Off CUDA they run under Triton's interpreter (TRITON_INTERPRET=1), which is how the CPU tests check them against
the torch paths they replace, bit for bit.
"""

from __future__ import annotations

import torch

from tlt.models.kernels import _on_device_of, triton

if triton is not None:
    import triton.language as tl


if triton is not None:

    @triton.jit
    def _whole_tree_kernel(FrontierIds, CandidateParents, Slot, Children, Parents, FED, NODES, K: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
        # one program per row: expansion e = 0 is the root (node 0), e >= 1 the frontier candidate e - 1 (node
        # id + 1); each node's expansion found by comparison (no scattered stores to order)
        b = tl.program_id(0).to(tl.int64)
        n = tl.arange(0, BLOCK_N)
        e = tl.arange(0, BLOCK_E)
        frontier = (e >= 1) & (e <= FED)
        expanded = tl.load(FrontierIds + b * FED + e - 1, mask=frontier, other=0) + 1
        expanded = tl.where(e == 0, 0, tl.where(frontier, expanded, -1))
        slot = tl.max(tl.where(n[:, None] == expanded[None, :], e[None, :], -1), 1)
        inside = n < NODES
        tl.store(Slot + b * NODES + n, slot.to(tl.int64), mask=inside)
        for j in tl.static_range(K):
            tl.store(Children + (b * NODES + n) * K + j, tl.where(slot >= 0, slot * K + j + 1, -1).to(tl.int64),
                     mask=inside)
        parent = tl.load(CandidateParents + b * (NODES - 1) + n - 1, mask=(n >= 1) & inside, other=-2) + 1
        tl.store(Parents + b * NODES + n, parent, mask=inside)


def whole_tree(frontier_ids: torch.Tensor | None, candidate_parents: torch.Tensor, k: int):
    """`tree.whole_tree_layout` in one launch (was ~12 operations): a whole tree's node tables from its expanded
    frontier candidates frontier_ids [B, F] (depth by depth; None: the root alone) and candidate_parents [B, N]
    (-1: the root): each node's expansion [B, N + 1] (-1: a leaf), children [B, N + 1, K] (expansion e drew nodes
    e K + 1 .. e K + K), parents [B, N + 1] (-1 for the root)."""
    batch, count = candidate_parents.shape
    nodes = count + 1
    device = candidate_parents.device
    fed = 0 if frontier_ids is None else frontier_ids.shape[1]
    frontier_ids = candidate_parents if frontier_ids is None else frontier_ids.contiguous()  # (unread when none)
    candidate_parents = candidate_parents.contiguous()
    slot = torch.empty(batch, nodes, dtype=torch.long, device=device)
    children = torch.empty(batch, nodes, k, dtype=torch.long, device=device)
    parents = torch.empty(batch, nodes, dtype=torch.long, device=device)
    with _on_device_of(candidate_parents):
        _whole_tree_kernel[(batch,)](frontier_ids, candidate_parents, slot, children, parents, fed, nodes, K=k,
                                     BLOCK_N=triton.next_power_of_2(nodes), BLOCK_E=triton.next_power_of_2(fed + 1),
                                     num_warps=1)
    return slot, children, parents


if triton is not None:

    @triton.jit
    def _gather_pairs_kernel(SlotTokens, SlotFeatures, Pending, Committed, Seen, Until, Tokens, Features, Last,
                             tok_sr, feat_sr, feat_ss, WIDTH, LIMIT, HIDDEN, BLOCK_H: tl.constexpr):
        # program (row b, pair w): pair i = seen + w is (x_{i+1}, f_i), x_committed the pending token; reads past
        # the cache clamped (pairs past a row's `until` are padding)
        b = tl.program_id(0).to(tl.int64)
        w = tl.program_id(1)
        seen = tl.load(Seen + b)
        pair = seen + w
        following = tl.load(SlotTokens + b * tok_sr + tl.minimum(pair + 1, LIMIT))
        token = tl.where(pair + 1 == tl.load(Committed + b), tl.load(Pending + b), following)
        tl.store(Tokens + b * WIDTH + w, token)
        source = SlotFeatures + b * feat_sr + tl.minimum(pair, LIMIT) * feat_ss
        target = Features + (b * WIDTH + w) * HIDDEN
        h = tl.arange(0, BLOCK_H)
        for h0 in range(0, HIDDEN, BLOCK_H):
            inside = h0 + h < HIDDEN
            tl.store(target + h0 + h, tl.load(source + h0 + h, mask=inside), mask=inside)
        if w == 0:  # the pair whose output is the tree's root
            tl.store(Last + b, tl.maximum(tl.load(Until + b) - seen - 1, 0))


def gather_pairs(slot_tokens: torch.Tensor, slot_features: torch.Tensor, pending: torch.Tensor,
                 committed: torch.Tensor, seen: torch.Tensor, until: torch.Tensor, width: int):
    """The drafter's catch-up inputs in one launch (`SpeculativeDecoder.feed_pairs`, where they took ~13
    operations): pairs [seen, seen + width) of each row's "tokens" / "features" slot data [B, S] / [B, S, H]
    as (tokens [B, W], features [B, W, H]), the pending token [B] as x_committed, and the index of each row's
    last pair, until - seen - 1 (at least 0) [B]."""
    batch, capacity = slot_tokens.shape
    hidden = slot_features.shape[-1]
    if slot_features.stride(-1) != 1:
        raise ValueError("gather_pairs reads the features' last dimension contiguously")
    device = slot_tokens.device
    tokens = torch.empty(batch, width, dtype=slot_tokens.dtype, device=device)
    features = torch.empty(batch, width, hidden, dtype=slot_features.dtype, device=device)
    last = torch.empty(batch, dtype=torch.long, device=device)
    pending, committed, seen, until = (t.contiguous() for t in (pending, committed, seen, until))
    with _on_device_of(slot_tokens):
        _gather_pairs_kernel[(batch, width)](
            slot_tokens, slot_features, pending, committed, seen, until, tokens, features, last,
            slot_tokens.stride(0), slot_features.stride(0), slot_features.stride(1), width, capacity - 1, hidden,
            BLOCK_H=min(1024, triton.next_power_of_2(hidden)), num_warps=1)
    return tokens, features, last


if triton is not None:

    @triton.jit
    def _commit_path_kernel(KV, SlotTokens, SlotFeatures, Lengths, Path, Counts, TreeTokens, Hidden,
                            kv_s0, kv_s1, kv_sr, kv_sh, kv_ss, tok_sr, feat_sr, feat_ss, path_sb, h_sb, h_sn,
                            LAYERS, KV_HEADS, NODES, WIDTH, CAPACITY, HIDDEN, HEAD_DIM: tl.constexpr,
                            MOVE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
        # program (row b, plane): planes 0 .. 2 L Hkv - 1 move one (K or V, layer, KV head)'s path slots to the
        # front of the written block; the last plane writes the slot data (every node's token and feature, the
        # path's in front)
        b = tl.program_id(0).to(tl.int64)
        plane = tl.program_id(1)
        base = tl.load(Lengths + b)
        count = base * 0
        if MOVE:
            count = tl.load(Counts + b)
        if plane < 2 * LAYERS * KV_HEADS:
            if MOVE:
                which = plane // (LAYERS * KV_HEADS)
                layer = (plane // KV_HEADS) % LAYERS
                head = plane % KV_HEADS
                start = KV + which * kv_s0 + layer * kv_s1 + b * kv_sr + head * kv_sh
                d = tl.arange(0, BLOCK_D)
                # in path order: path[i] >= i (a node's index is at least its depth), so slot base + path[i] is
                # never one an earlier move overwrote; each lane reads and writes its own d
                for i in range(1, WIDTH):
                    node = tl.load(Path + b * path_sb + i, mask=i < count, other=0)
                    ok = (d < HEAD_DIM) & (d * 0 + i < count) & (d * 0 + base + i < CAPACITY)
                    moved = tl.load(start + (base + node) * kv_ss + d, mask=ok)
                    tl.store(start + (base + i) * kv_ss + d, moved, mask=ok)
        else:
            h = tl.arange(0, BLOCK_H)
            for i in range(0, NODES):
                node = i + 0 * base
                if MOVE:
                    node = tl.load(Path + b * path_sb + i, mask=i < count, other=i).to(tl.int64)
                    node = tl.where(i < count, node, i)
                slot = base + i
                if slot < CAPACITY:
                    tl.store(SlotTokens + b * tok_sr + slot, tl.load(TreeTokens + b * NODES + node))
                    source = Hidden + b * h_sb + node * h_sn
                    target = SlotFeatures + b * feat_sr + slot * feat_ss
                    for h0 in range(0, HIDDEN, BLOCK_H):
                        inside = h0 + h < HIDDEN
                        tl.store(target + h0 + h, tl.load(source + h0 + h, mask=inside), mask=inside)


def commit_path(rows, lengths: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, path: torch.Tensor | None,
                counts: torch.Tensor | None) -> None:
    """A verified tree's writes in one launch, where `CacheRows.write_slots` twice and `gather_written` took ~19
    operations: every node's token and feature (tokens [B, N + 1], hidden [B, N + 1, H]) into the "tokens" and
    "features" slot data at slots lengths + node of `rows` (a `CacheRows` whose slot data is exactly those
    two), then, path [B, W] and counts [B] given, the first counts[b] nodes of the path moved to the front of
    the written block in every layer's K and V and in the slot data (`gather_written`); nothing committed."""
    cache = rows.cache
    kv = cache.kv[:, :, rows.start:rows.start + rows.count]               # [2, L, B, Hkv, S, D]
    slot_tokens, slot_features = rows.slots("tokens"), rows.slots("features")
    batch, nodes = tokens.shape
    if set(cache.slot_data) != {"tokens", "features"} or kv.stride(-1) != 1 or slot_features.stride(-1) != 1:
        raise ValueError("commit_path writes a cache whose slot data is its tokens and features, each contiguous")
    move = path is not None
    tokens = tokens.contiguous()
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    path = path.contiguous() if move else tokens  # (a placeholder: unread without a move)
    counts = counts.contiguous() if move else lengths
    layers, kv_heads, dim = kv.shape[1], kv.shape[3], kv.shape[5]
    with _on_device_of(tokens):
        _commit_path_kernel[(batch, 2 * layers * kv_heads + 1)](
            kv, slot_tokens, slot_features, lengths, path, counts, tokens, hidden,
            kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4), slot_tokens.stride(0),
            slot_features.stride(0), slot_features.stride(1), path.stride(0), hidden.stride(0), hidden.stride(1),
            layers, kv_heads, nodes, path.shape[1], kv.shape[4], hidden.shape[-1], HEAD_DIM=dim, MOVE=move,
            BLOCK_D=triton.next_power_of_2(dim), BLOCK_H=min(1024, triton.next_power_of_2(hidden.shape[-1])),
            num_warps=1)


if triton is not None:

    @triton.jit
    def _ancestor_mask_kernel(Parents, Mask, NODES, DEPTH: tl.constexpr, BLOCK: tl.constexpr):
        # one program per (row b, node n): its mask row, itself and every ancestor (the root is its own parent)
        row = tl.program_id(0).to(tl.int64)
        b = row // NODES
        node = row % NODES
        cols = tl.arange(0, BLOCK)
        visible = cols == node
        for _ in tl.static_range(DEPTH):
            node = tl.maximum(tl.load(Parents + b * NODES + node), 0)
            visible = visible | (cols == node)
        tl.store(Mask + row * NODES + cols, visible, mask=cols < NODES)


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """`DraftTree.attention` in one launch, where walking the nodes up one ancestor a round took ~14 operations:
    [B, N + 1, N + 1] bool, each node sees itself and its ancestors; parents [B, N + 1] (-1 for the root)."""
    batch, nodes = parents.shape
    parents = parents.contiguous()
    mask = torch.empty(batch, nodes, nodes, dtype=torch.bool, device=parents.device)
    with _on_device_of(parents):
        _ancestor_mask_kernel[(batch * nodes,)](parents, mask, nodes, DEPTH=max_depth,
                                                BLOCK=triton.next_power_of_2(nodes), num_warps=1)
    return mask


if triton is not None:

    @triton.jit
    def _follow_q_path_kernel(Choice, Final, Children, Tokens, LogP, Path, Accepted, Emitted, OutTokens, OutLogP,
                              Packed, NODES, lp_sb, lp_sn, WIDTH, K: tl.constexpr, STEPS: tl.constexpr):
        # one program per row: from the root, each node emits its accepted child's token and moves there, or
        # emits its final token and stops (then -1 / 0.0 to the end); the same in float64 into the row of the
        # step's one host transfer (tokens, log-probs, path, accepted: `decoder.pack`'s layout)
        b = tl.program_id(0).to(tl.int64)
        node = tl.zeros([], tl.int64)
        alive = node == 0
        accepted = tl.zeros([], tl.int64)
        for i in tl.static_range(STEPS):
            at = b * NODES + node
            choice = tl.load(Choice + at, mask=alive, other=-1)
            found = alive & (choice >= 0)
            child = tl.load(Children + at * K + tl.maximum(choice, 0), mask=found, other=-1)
            token = tl.where(found, tl.load(Tokens + b * NODES + tl.maximum(child, 0), mask=found, other=0),
                             tl.load(Final + at, mask=alive, other=-1))
            logp = tl.load(LogP + b * lp_sb + node * lp_sn + tl.maximum(token, 0), mask=alive, other=0.0)
            path, token, logp = tl.where(alive, node, -1), tl.where(alive, token, -1), \
                tl.where(alive, logp.to(tl.float32), 0.0)
            tl.store(Path + b * WIDTH + i, path)
            tl.store(OutTokens + b * WIDTH + i, token)
            tl.store(OutLogP + b * WIDTH + i, logp)
            packed = Packed + b * (3 * WIDTH + 1)
            tl.store(packed + i, token.to(tl.float64))
            tl.store(packed + WIDTH + i, logp.to(tl.float64))
            tl.store(packed + 2 * WIDTH + i, path.to(tl.float64))
            if i > 0:
                accepted += alive.to(tl.int64)
            alive = found
            node = tl.where(found, child, node)
        tl.store(Accepted + b, accepted)
        tl.store(Emitted + b, accepted + 1)
        tl.store(Packed + b * (3 * WIDTH + 1) + 3 * WIDTH, accepted.to(tl.float64))


def follow_q_path(choice: torch.Tensor, final: torch.Tensor, children: torch.Tensor, tokens: torch.Tensor,
                  logprobs: torch.Tensor, max_depth: int):
    """What `q_sampling._accept_q_every_node` makes of `verify_q_nodes`' (choice, final) in one launch, where
    its torch operations (`acceptance.follow_accepted`, `along`, the gathers) were ~30: each row's accepted
    path (the root, then the accepted nodes, -1 padded) [B, S + 2], accepted count [B], the emitted tokens
    [B, S + 2] (-1 padded), their log-probs under logprobs [B, N + 1, V] (float32, 0 padded), the emitted count
    [B], and all of it packed for the host (`decoder.pack`, whose 5 operations it saves): an `Acceptance`'s
    fields. children [B, N + 1, K], tokens [B, N + 1] the tree's."""
    batch, nodes = choice.shape
    k = children.shape[-1]
    width = max_depth + 2
    if logprobs.stride(-1) != 1:
        raise ValueError("follow_q_path reads logprobs' last dimension contiguously")
    choice, final, children, tokens = (t.contiguous() for t in (choice, final, children, tokens))
    device = choice.device
    path = torch.empty(batch, width, dtype=torch.long, device=device)
    out_tokens = torch.empty(batch, width, dtype=torch.long, device=device)
    out_logprobs = torch.empty(batch, width, dtype=torch.float32, device=device)
    counts = torch.empty(2, batch, dtype=torch.long, device=device)  # accepted, emitted: one allocation
    packed = torch.empty(batch, 3 * width + 1, dtype=torch.float64, device=device)
    with _on_device_of(choice):
        _follow_q_path_kernel[(batch,)](
            choice, final, children, tokens, logprobs, path, counts[0], counts[1], out_tokens, out_logprobs,
            packed, nodes, logprobs.stride(0), logprobs.stride(1), width, K=k, STEPS=width, num_warps=1)
    return path, counts[0], out_tokens, out_logprobs, counts[1], packed
