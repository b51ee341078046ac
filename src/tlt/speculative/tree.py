"""Drafting a token tree with the EAGLE drafter (EAGLE-2 dynamic tree), batched over rows.

Depth 1 expands the root into its top-K draft tokens. At every further depth the K best frontier nodes (by
cumulative draft log-probability) are each expanded into their top-K children; finally the N best candidates of
all depths form the tree. A child's cumulative score never exceeds its parent's, so the kept set is closed under
ancestors (ties are broken toward shallower, earlier candidates, which come first).

Nodes are numbered 1..N in the order (depth, candidate order), so a parent always precedes its children; index 0
is the root (the pending token, whose target distribution decides the depth-1 children).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tlt.models.constants import made_once
from tlt.models.kv_cache import CacheRows
from tlt.sampling import fused_draws
from tlt.speculative.strategy import SpecStrategy


@dataclass
class DraftTree:
    tokens: torch.Tensor    # [B, N + 1] target ids; column 0 is the root (pending) token
    parents: torch.Tensor   # [B, N + 1] parent index (-1 for the root)
    depths: torch.Tensor    # [B, N + 1] 0 for the root
    children: torch.Tensor  # [B, N + 1, K] child indices in draft-score order, -1 padded
    max_depth: int          # the strategy's depth S: loops over depths never read the tensors above on the host
    chain: bool = False     # node d's only child is node d + 1 (branching 1): the mask is causal
    causal: torch.Tensor | None = None  # a chain's causal mask [B, N + 1, N + 1] (`chain_tables`), when made

    @property
    def size(self) -> int:
        return self.tokens.shape[1] - 1

    def attention(self) -> torch.Tensor:
        """[B, N + 1, N + 1] bool: each node sees itself and its ancestors (the tree mask for verification).

        Walks every node up one ancestor per round, S rounds (a node at depth d has d ancestors; the root is
        its own parent, so finished walks stay there): S small kernels, whatever the tree's size; on the Triton
        kernels one (`tree_kernels.ancestor_mask`). A chain's mask is causal: two."""
        batch, count = self.parents.shape
        if self.causal is not None:
            return self.causal
        if self.chain:
            return torch.ones(count, count, dtype=torch.bool, device=self.parents.device).tril().expand(batch, -1, -1)
        fused = fused_draws().tree_mask
        if fused is not None:
            return fused(self.parents, self.max_depth)
        nodes = torch.arange(count, device=self.parents.device)
        visible = (nodes[:, None] == nodes[None, :]).expand(batch, -1, -1).clone()
        parent = self.parents.clamp(min=0)
        ancestor = parent
        for _ in range(self.max_depth):
            visible.scatter_(2, ancestor[:, :, None], True)
            ancestor = parent.gather(1, ancestor)
        return visible


@dataclass
class Candidates:
    """Every drafted candidate [B, C]; parents index candidates (-1 = the root). expanded: per expansion, the
    candidate ids it expanded ([B, F], -1 = the root) and the draft distribution the children came from
    ([B, F, Vd] log-probs over the draft vocabulary), kept only when a pick returns one (q-sampling).
    frontiers: a tree's expanded candidate ids [B, K] at depths 2..S, in order (None for a chain)."""

    tokens: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor
    expanded: list[tuple[torch.Tensor, torch.Tensor]]
    frontiers: list[torch.Tensor] | None = None
    chain: bool = False  # branching 1: candidate d's parent is d - 1 and expansion d drew it
    layout: "TreeLayout | None" = None  # `whole_tree_layout`, once made

    @property
    def branching(self) -> int:
        """K of a tree: its frontiers' width, or (depth 1: no frontier) the root's children, every candidate."""
        return self.frontiers[0].shape[1] if self.frontiers else self.tokens.shape[1]


def top_children(logits: torch.Tensor, k: int, depth: int):
    """Target-only rule: the K most probable draft tokens (draft-vocabulary ids) and their log-probs."""
    scores, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return scores, ids, None


def draft_tree(drafter, root_hidden: torch.Tensor, cache: CacheRows, base_positions: torch.Tensor,
               strategy: SpecStrategy, pick=top_children, kv_len: int | None = None) -> Candidates:
    """Grow candidates from root_hidden [B, H] (the drafter's output at the last committed pair).

    pick(logits [B, F, Vd], k, depth) -> (log-scores [B, F, K], draft ids [B, F, K], distribution or None)
    chooses each expanded node's K children. The drafter cache holds the committed pairs; the frontier nodes'
    pairs are written past them, uncommitted: each depth re-runs all frontier nodes so far with a mask that shows
    every node only its own path (a few dozen one-layer token-steps at most; `EagleDrafter.tree_tables`); a chain
    (K = 1) feeds only its newest node. base_positions [B] (device): the position of the first draft pair, which
    is also the drafter cache's committed length; kv_len: the drafter's attention span (a CUDA graph fixes it;
    default: from the lengths).
    """
    if strategy.branching == 1:
        return _draft_chain(drafter, root_hidden, cache, base_positions, strategy, pick, kv_len)
    k = strategy.branching
    batch, hidden_size = root_hidden.shape
    device = root_hidden.device
    scores, ids, dist = pick(drafter.draft_logits(root_hidden)[:, None], k, 1)
    expanded = [] if dist is None else [(torch.full((batch, 1), -1, dtype=torch.long, device=device), dist)]
    # every candidate's record, and the frontier nodes each pass feeds, written depth by depth into buffers
    count = k + (strategy.depth - 1) * k * k
    tokens = torch.empty(batch, count, dtype=torch.long, device=device)
    all_scores = torch.empty(batch, count, dtype=scores.dtype, device=device)
    parents = torch.empty(batch, count, dtype=torch.long, device=device)
    tokens[:, :k] = drafter.to_target_ids(ids[:, 0])
    all_scores[:, :k] = scores[:, 0]
    parents[:, :k].fill_(-1)  # (an assigned Python scalar would build a tensor from host data)
    fed = (strategy.depth - 1) * k
    path_tokens = torch.empty(batch, fed, dtype=torch.long, device=device)
    path_features = torch.empty(batch, fed, hidden_size, dtype=root_hidden.dtype, device=device)
    if fed:
        path_tokens[:, :k] = tokens[:, :k]
        path_features[:, :k] = root_hidden[:, None]
    frontier = torch.arange(k, device=device).expand(batch, k)        # candidate ids of the frontier
    frontiers = []
    expand = fused_draws().expand_frontier or _expand_frontier
    # every pass's slots, RoPE and attention rows, made once (a node's row as soon as its parent is chosen)
    tables = drafter.tree_tables(cache, base_positions.to(device), strategy.depth, k, kv_len) \
        if strategy.depth > 1 else None  # depth 1: the root's children are the whole tree, no pass
    for depth in range(2, strategy.depth + 1):
        frontiers.append(frontier)
        nodes = (depth - 1) * k
        hidden = drafter.step(path_tokens[:, :nodes], path_features[:, :nodes], cache, None,
                              tables=tables.at(nodes, depth - 2))[:, -k:]  # the newest frontier [B, K, H]
        child_scores, child_ids, dist = pick(drafter.draft_logits(hidden), k, depth)
        if dist is not None:
            expanded.append((frontier, dist))
        frontier, _ = expand(tokens, all_scores, parents, path_tokens, path_features, frontier, child_scores,
                             drafter.to_target_ids(child_ids), hidden, k + (depth - 2) * k * k,
                             nodes if depth < strategy.depth else None, tables)
    return Candidates(tokens, all_scores, parents, expanded, frontiers)


def _expand_frontier(tokens, scores, parents, path_tokens, path_features, frontier, child_scores, child_tokens,
                     hidden, first: int, feed_at: int | None, tables):
    """Record a drafted depth: the K children of each frontier node (scores [B, K, K], target ids) become
    candidates first .. first + K^2 - 1 (cumulative score, token, parent); the K best become the next frontier,
    ties to the earlier candidate, whose tokens and parents' features are fed to the next pass at path column
    feed_at (None: the last depth), and whose attention rows `tables` gets (`TreeTables.add_nodes`). Returns
    (the new frontier's candidate ids, their parents' frontier slots) [B, K] each.
    models/draft_kernels.expand_frontier is this in one launch."""
    batch, k, _ = child_scores.shape
    new = slice(first, first + k * k)
    total = (scores.gather(1, frontier)[:, :, None] + child_scores).reshape(batch, k * k)
    scores[:, new] = total
    tokens[:, new] = child_tokens.reshape(batch, k * k)
    parents[:, new] = frontier[:, :, None].expand(-1, -1, k).reshape(batch, k * k)
    best = torch.sort(total, dim=-1, descending=True, stable=True).indices[:, :k]  # local ids of the new frontier
    frontier_parent = best // k
    frontier = first + best
    if feed_at is not None:
        path_tokens[:, feed_at:feed_at + k] = tokens.gather(1, frontier)
        path_features[:, feed_at:feed_at + k] = hidden.gather(
            1, frontier_parent[:, :, None].expand(-1, -1, hidden.shape[-1]))
        tables.add_nodes(feed_at, k, frontier_parent)
    return frontier, frontier_parent


def _draft_chain(drafter, root_hidden: torch.Tensor, cache: CacheRows, base_positions: torch.Tensor,
                 strategy: SpecStrategy, pick, kv_len: int | None) -> Candidates:
    """`draft_tree` for K = 1, the same candidates without a tree's bookkeeping (no frontier to rank or gather:
    the newest node is the frontier): candidate d is at depth d + 1, its parent is d - 1.

    Each pass feeds only the newest node [B, 1]: every earlier node is an ancestor, and the earlier passes left
    its KV at slot base + its index (the same inputs at the same positions would write the same values again),
    so the newest node sees the committed pairs and them as a plain continuation: one token per pass instead of
    depth - 1. The passes' slots, masks and RoPE tables are made once (`EagleDrafter.chain_tables`)."""
    batch = root_hidden.shape[0]
    device = root_hidden.device
    base = base_positions.to(device)
    # candidate d's parent, d - 1, is also the expansion that drew it (-1: the root): constants, no operations
    nodes = chain_tables(strategy.depth, batch, device).parents[:, :-1]             # [B, S]: -1 .. S - 2
    scores, ids, dist = pick(drafter.draft_logits(root_hidden)[:, None], 1, 1)
    tokens, step_scores = [drafter.to_target_ids(ids[:, 0])], [scores[:, 0]]
    expanded = [] if dist is None else [(nodes[:, :1], dist)]
    hidden = root_hidden[:, None]
    tables = drafter.chain_tables(cache, base, strategy.depth - 1, kv_len) if strategy.depth > 1 else None
    for depth in range(2, strategy.depth + 1):
        hidden = drafter.step(tokens[-1], hidden, cache, None, tables=tables.at(depth - 2))
        child_scores, child_ids, dist = pick(drafter.draft_logits(hidden), 1, depth)
        if dist is not None:
            expanded.append((nodes[:, depth - 1:depth], dist))
        step_scores.append(child_scores.reshape(batch, 1))
        tokens.append(drafter.to_target_ids(child_ids).reshape(batch, 1))
    # cumulative draft scores in one scan (a chain keeps every candidate: nothing ranks them)
    return Candidates(torch.cat(tokens, 1), torch.cat(step_scores, 1).cumsum(1), nodes, expanded, chain=True)


def select_tree(root_tokens: torch.Tensor, candidates: Candidates, strategy: SpecStrategy) -> DraftTree:
    """Keep the N best candidates (closed under ancestors), renumbered 1..N in candidate order.

    Children are offered to the acceptance rule best draft score first (target-only) or in the order they
    were sampled (q-sampling: recursive rejection sampling is exact only in draw order)."""
    if strategy.branching == 1:  # a chain keeps its S candidates (N = S), as they are
        return _chain_tree(root_tokens, candidates.tokens, strategy.depth)
    if candidates.frontiers is not None and strategy.tree_size == candidates.tokens.shape[1]:
        return _whole_tree(root_tokens, candidates, strategy)
    return _best_tree(root_tokens, candidates, strategy)


def _chain_tree(root_tokens: torch.Tensor, tokens: torch.Tensor, depth: int) -> DraftTree:
    """`_best_tree` of a chain without sorting: node d (depth d) has parent d - 1 and child d + 1, constant tables
    (`chain_tables`); only the tokens are this step's."""
    tables = chain_tables(depth, root_tokens.shape[0], root_tokens.device)
    return DraftTree(torch.cat([root_tokens[:, None], tokens], 1), tables.parents, tables.depths, tables.children,
                     depth, chain=True, causal=tables.causal)


@dataclass
class ChainConstants:
    """What a chain of depth S looks like for B rows, whatever was drafted: node parents [B, S + 1] (-1 for the
    root), depths [B, S + 1], children [B, S + 1, 1] (-1 for the leaf), its causal mask [B, S + 1, S + 1] and each
    node's row in the drafts' distributions (node d < S: d; the leaf -1) [B, S + 1]. Contiguous, batch-sized:
    the kernels that read them take them as they are."""

    parents: torch.Tensor
    depths: torch.Tensor
    children: torch.Tensor
    causal: torch.Tensor
    dist_slots: torch.Tensor


def chain_tables(depth: int, batch: int, device) -> ChainConstants:
    def rows(table: torch.Tensor) -> torch.Tensor:
        return table.expand(batch, *table.shape).contiguous()

    def make() -> ChainConstants:
        nodes = torch.arange(depth + 1, device=device)
        inner = nodes < depth
        return ChainConstants(rows(nodes - 1), rows(nodes), rows(torch.where(inner, nodes + 1, -1)[:, None]),
                              rows(torch.ones(depth + 1, depth + 1, dtype=torch.bool, device=device).tril()),
                              rows(torch.where(inner, nodes, -1)))
    return step_constant(("chain", depth, batch), device, make)


def _whole_tree(root_tokens: torch.Tensor, candidates: Candidates, strategy: SpecStrategy) -> DraftTree:
    """`_best_tree` when every candidate is kept (a q-sampling tree always is): node = candidate + 1, and the
    children of an expanded node are the K consecutive candidates its expansion drew, in draw order (which is
    best draft score first under the target-only rule: `top_children` returns them sorted). So no sort and no
    ranking: `whole_tree_layout`."""
    layout = whole_tree_layout(candidates)
    depths, _ = _whole_tree_tables(strategy.depth, strategy.branching, root_tokens.device)
    return DraftTree(torch.cat([root_tokens[:, None], candidates.tokens], 1), layout.parents,
                     depths.expand(root_tokens.shape[0], -1), layout.children, strategy.depth)


@dataclass
class TreeLayout:
    """A whole tree's node tables: slot [B, N + 1] each node's expansion (its row among the drawn distributions,
    -1 for a leaf), children [B, N + 1, K], parents [B, N + 1] (-1 for the root)."""

    slot: torch.Tensor
    children: torch.Tensor
    parents: torch.Tensor


def whole_tree_layout(candidates: Candidates) -> TreeLayout:
    """The node tables of a tree that keeps every candidate (node = candidate + 1), made once per drafted tree
    (the tree and its q distributions both read them): the expanded nodes, the root then each depth's frontier,
    get their children in one scatter from tables that depend on S and K alone. On the Triton kernels one
    launch (`tree_kernels.whole_tree`)."""
    if candidates.layout is not None:
        return candidates.layout
    frontiers, parents, k = candidates.frontiers, candidates.parents, candidates.branching
    frontier_ids = torch.cat(frontiers, 1) if frontiers else None                  # candidate ids [B, F]
    fused = fused_draws().whole_tree
    if fused is not None:
        candidates.layout = TreeLayout(*fused(frontier_ids, parents, k))
        return candidates.layout
    batch, count = parents.shape
    depth = 1 + (count - k) // (k * k)
    _, child_nodes = _whole_tree_tables(depth, k, parents.device)
    expanded = F.pad(frontier_ids + 1, (1, 0)) if frontier_ids is not None else \
        torch.zeros(batch, 1, dtype=torch.long, device=parents.device)             # node ids [B, E], the root first
    slot = torch.full((batch, count + 1), -1, dtype=torch.long, device=parents.device)
    slot.scatter_(1, expanded, torch.arange(expanded.shape[1], device=parents.device).expand(batch, -1))
    children = torch.full((batch, count + 1, k), -1, dtype=torch.long, device=parents.device)
    children.scatter_(1, expanded[:, :, None].expand(-1, -1, k), child_nodes[:expanded.shape[1]].expand(batch, -1, -1))
    candidates.layout = TreeLayout(slot, children, F.pad(parents, (1, 0), value=-2) + 1)
    return candidates.layout


_STEP_CONSTANTS: dict[tuple, object] = {}


def step_constant(key: tuple, device, make):
    """make(): tensors that depend on a step's shapes alone (a strategy, a batch size), made once per key and
    device (`made_once`: a graph's warm-up makes them before its capture, so they are constants of the captured
    step, not operations)."""
    return made_once(_STEP_CONSTANTS, key + (str(device),), make)


def _whole_tree_tables(depth: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(node depths [N + 1], children of each expansion's node [E, K]) of a whole tree: expansion e (the root,
    then frontier slot by slot, depth by depth) drew candidates e K .. e K + K - 1."""
    def make():
        ids = torch.arange(k + (depth - 1) * k * k, device=device)
        return F.pad(candidate_depths(ids, k), (1, 0)), (ids + 1).view(-1, k)
    return step_constant(("whole tree", depth, k), device, make)


def _best_tree(root_tokens: torch.Tensor, candidates: Candidates, strategy: SpecStrategy) -> DraftTree:
    tokens, scores, parents = candidates.tokens, candidates.scores, candidates.parents
    batch, count = tokens.shape
    device = tokens.device
    n = strategy.tree_size
    # Stable ordering: candidates are already in (depth, expansion) order, so among equal scores a parent wins.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :n]
    keep = torch.sort(order, dim=-1).values                              # [B, N] candidate ids, parents first
    new_index = torch.full((batch, count), -1, dtype=torch.long, device=device)
    new_index.scatter_(1, keep, torch.arange(1, n + 1, device=device).expand(batch, n))
    kept_parents = parents.gather(1, keep)
    node_parents = torch.where(kept_parents < 0, torch.zeros_like(kept_parents),
                               new_index.gather(1, kept_parents.clamp(min=0)))
    tree_tokens = torch.cat([root_tokens[:, None], tokens.gather(1, keep)], 1)
    tree_parents = torch.cat([torch.full((batch, 1), -1, device=device, dtype=torch.long), node_parents], 1)
    depths = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device),
                        candidate_depths(keep, strategy.branching)], 1)
    node_scores = torch.cat([torch.zeros(batch, 1, device=device), scores.gather(1, keep)], 1)
    if strategy.rule == "q":  # draw order = candidate order
        node_scores = -torch.arange(n + 1, device=device, dtype=node_scores.dtype).expand(batch, -1)
    return DraftTree(tree_tokens, tree_parents, depths, _children_table(tree_parents, node_scores, strategy.branching),
                     strategy.depth)


def candidate_depths(ids: torch.Tensor, k: int) -> torch.Tensor:
    """The depth of candidate ids: `draft_tree` numbers K candidates at depth 1, then K^2 per further depth."""
    deeper = 2 + torch.div((ids - k).clamp(min=0), k * k, rounding_mode="floor")
    return torch.where(ids < k, torch.ones_like(ids), deeper)


def _children_table(parents: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """[B, N + 1, K] children of every node, best draft score first, -1 padded."""
    batch, count = parents.shape
    table = torch.full((batch, count, k), -1, dtype=torch.long, device=parents.device)
    is_child = parents[:, None, :] == torch.arange(count, device=parents.device)[None, :, None]  # [B, node, cand]
    ranked = torch.where(is_child, scores[:, None, :], torch.full_like(scores[:, None, :], -float("inf")))
    best = ranked.topk(min(k, count), dim=-1)
    valid = torch.isfinite(best.values)
    table[:, :, :best.indices.shape[-1]] = torch.where(valid, best.indices, torch.full_like(best.indices, -1))
    return table
