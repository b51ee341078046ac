"""Speculative sampling with the drafter's own probabilities q, for chains and trees (exact for every q).

Drafting: every expanded node's K children are drawn from the drafter's processed distribution q (the same
temperature / top-k / top-p as the target) without replacement, in order c_1, c_2, ...: c_i is drawn from q_i,
which is q with c_1..c_{i-1} removed and renormalized. Greedy rows take the top-K of q instead.

Verification at a node with target distribution p, by recursive rejection sampling (Jeon et al. 2024,
"Recursive Speculative Decoding"; for K = 1 it is Leviathan et al. 2023):

    r_0 = p
    for i = 1..K:  accept c_i with probability min(1, r_{i-1}(c_i) / q_i(c_i))
                   on rejection r_i = normalize(max(0, r_{i-1} - q_i))
    if every child was rejected: emit a sample of r_K and stop

Why it is exact: for a proposal c ~ q_i, "accept with min(1, r/q_i), else continue with (r - q_i)+" emits x with
probability min(q_i(x), r(x)) + (1 - sum min(q_i, r)) * (r(x) - min(q_i(x), r(x))) / sum (r - q_i)+ = r(x),
because sum (r - q_i)+ = 1 - sum min(q_i, r). The rest of the procedure after a rejection emits a sample of
r_i whatever c_i was (induction over i, for any proposal q_{i+1}), so the node emits a sample of r_0 = p. An
accepted child continues the same way at its own node, whose children were drawn independently of this
node's coins, so every emitted token is an exact sample of the target given the tokens before it.

Why without replacement and every child kept: a duplicate child wastes a verified slot, and dropping some of
a node's sampled children by their draft score (EAGLE-2's N-best selection) would bias the draws; which nodes
get expanded may depend on their own draft scores, since their children are drawn after that choice.
Acceptance of one drafted token is 1 - TV(p, q) at depth 1 for a chain, instead of p(argmax q) for the
target-only rule: a drafter trained toward the target's whole distribution is worth its probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.models.eagle import inverse_vocabulary
from tlt.sampling import RowSampling, fused_draws, processed_logprobs, sample_from_logprobs
from tlt.speculative.acceptance import Acceptance, TreeWalk, along, follow_accepted
from tlt.speculative.tree import Candidates, DraftTree, chain_tables, whole_tree_layout


@dataclass
class DraftDistributions:
    """The distributions children were drawn from: dists [B, E, Vd] log-probs over the draft vocabulary of the
    E expanded nodes; slot [B, N + 1] maps a tree node to its row in dists (-1 = a leaf)."""

    dists: torch.Tensor
    slot: torch.Tensor

    @classmethod
    def from_candidates(cls, candidates: Candidates, tree_nodes: int) -> "DraftDistributions":
        """Every candidate is kept in order (tree node = candidate id + 1, the root is node 0)."""
        dists = torch.cat([dist for _, dist in candidates.expanded], 1)
        if candidates.chain:  # node d < S was expanded d-th: a constant table
            return cls(dists, chain_tables(len(candidates.expanded), dists.shape[0], dists.device).dist_slots)
        if candidates.frontiers is not None and candidates.tokens.shape[1] + 1 == tree_nodes:  # a whole tree
            return cls(dists, whole_tree_layout(candidates).slot)
        ids = torch.cat([node_ids for node_ids, _ in candidates.expanded], 1) + 1  # [B, E]
        batch, expanded = ids.shape
        slot = torch.full((batch, tree_nodes), -1, dtype=torch.long, device=ids.device)
        slot.scatter_(1, ids, torch.arange(expanded, device=ids.device).expand(batch, -1))
        return cls(dists, slot)


def sampling_pick(settings: RowSampling, uniforms: torch.Tensor):
    """A `draft_tree` pick that draws children from q without replacement; uniforms [B, tree_size]."""
    used = 0

    def pick(logits: torch.Tensor, k: int, depth: int):
        nonlocal used
        batch, frontier, _ = logits.shape
        logq = processed_logprobs(logits, settings)                      # [B, F, Vd]
        draws = uniforms[:, used:used + frontier * k].reshape(batch, frontier, k)
        used += frontier * k
        scores, ids = draw_without_replacement(logq, draws, settings.greedy)
        return scores, ids, logq

    return pick


def draw_without_replacement(logq: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor):
    """K sequential draws per row of logq [B, F, V] from uniforms [B, F, K]; greedy rows [B] take the top-K.

    Returns (log q of each drawn token [B, F, K], with -inf for a draw made after q ran out of mass, and the
    token ids [B, F, K]). Such a draw has q_i = 0: the acceptance rule never accepts it. On the Triton kernels,
    one launch (models/draft_kernels.py) instead of ~14 operations."""
    fused = fused_draws().without_replacement
    if fused is not None:
        return fused(logq, uniforms, greedy)
    batch, frontier, vocab = logq.shape
    draws = uniforms.shape[-1]
    remaining = logq.clone() if draws > 1 else logq  # only a later draw needs the earlier ones removed
    scores, ids = [], []
    for i in range(draws):
        drawn = sample_from_logprobs(remaining.reshape(-1, vocab), uniforms[..., i].reshape(-1)).view(batch, frontier)
        drawn = torch.where(greedy[:, None], remaining.argmax(-1), drawn)
        # log q of the drawn token: `remaining` is logq but for the earlier draws' -inf, so this is also the
        # -inf of a draw that found no mass left (one operation where logq, isfinite and where were three)
        scores.append(remaining.gather(-1, drawn[..., None])[..., 0])
        ids.append(drawn)
        if i + 1 < draws:
            remaining.scatter_(-1, drawn[..., None], -torch.inf)
    if draws == 1:  # a chain: views instead of two stacks
        return scores[0][..., None], ids[0][..., None]
    return torch.stack(scores, -1), torch.stack(ids, -1)


def accept_q(tree: DraftTree, logprobs: torch.Tensor, drafts: DraftDistributions, draft_to_target, greedy,
             uniforms: torch.Tensor, *, accept_rule=None, residual_rule=None, sync_free: bool = False,
             target_to_draft: torch.Tensor | None = None) -> Acceptance:
    """logprobs [B, N + 1, V]: processed target log-probs at each node; uniforms [B, (S + 1) * (K + 1)].

    sync_free: as in `acceptance.accept` (a CUDA graph: every depth walked, nothing read on the host).
    accept_rule(u, r_c, q_c) -> bool [B] and residual_rule(r, q) -> the next residual can replace the exact
    rule's parts (tests use them to show that a biased rule is detected). target_to_draft: the inverse of
    draft_to_target (`inverse_vocabulary`), which the fused node tests read (made here when not given)."""
    if sync_free:
        return _accept_q_every_node(tree, logprobs, drafts, draft_to_target, greedy, uniforms, accept_rule,
                                    residual_rule, target_to_draft)
    batch, _, vocab = logprobs.shape
    device = logprobs.device
    k = tree.children.shape[-1]
    walk = TreeWalk(batch, tree.max_depth, device)
    for step in range(tree.max_depth + 1):
        node_logprobs = logprobs[walk.rows, walk.current]                          # [B, V]
        children = tree.children[walk.rows, walk.current]                         # [B, K]
        child_tokens = tree.tokens.gather(1, children.clamp(min=0))
        q = _draft_probs(drafts, walk.rows, walk.current, draft_to_target, vocab)  # [B, V]
        coins = uniforms[:, step * (k + 1):(step + 1) * (k + 1)].to(device)
        choice, residual = _verify_children(node_logprobs, q, children >= 0, child_tokens, coins, greedy,
                                            accept_rule, residual_rule, sync_free)
        found = (choice >= 0) & walk.active
        next_node = children.gather(1, choice.clamp(min=0)[:, None])[:, 0]
        emitted = child_tokens.gather(1, choice.clamp(min=0)[:, None])[:, 0]
        stop = walk.active & ~found
        if sync_free or bool(stop.any()):
            final = sample_from_logprobs(residual.log(), coins[:, k])
            final = torch.where(greedy, node_logprobs.argmax(-1), final)
            emitted = torch.where(stop, final, emitted)
        walk.record(step, found, next_node, emitted, node_logprobs.gather(1, emitted[:, None])[:, 0])
        if walk.finished(sync_free):
            break
    return walk.result()


def _accept_q_every_node(tree: DraftTree, logprobs, drafts: DraftDistributions, draft_to_target, greedy, uniforms,
                         accept_rule, residual_rule, target_to_draft=None) -> Acceptance:
    """`accept_q` for a CUDA graph. A graph cannot stop where rows stop, so a walk runs every sibling's residual
    update ([B, V] work, a dozen kernels) at each of the S + 1 depths. But a node's test needs only its own p,
    q, children and its depth's uniforms: so every node's test and final draw run at once, over [B (N + 1), V]
    (the verify's logits are that size already), and the walk then only follows the accepted children. The
    arithmetic of each node is the walk's, on the same uniforms: the same `Acceptance` (tested). On the Triton
    kernels the node tests and final draws are one launch (models/draft_kernels.verify_q_nodes), and the walk
    along the accepted children another (tree_kernels.follow_q_path)."""
    vocab = logprobs.shape[-1]
    fused = fused_draws()
    if fused.verify_q_nodes is not None and accept_rule is None and residual_rule is None:  # one launch
        if target_to_draft is None and draft_to_target is not None:
            target_to_draft = inverse_vocabulary(draft_to_target, vocab)
        choice, final = fused.verify_q_nodes(logprobs, drafts.dists, drafts.slot, target_to_draft, tree.children,
                                             tree.tokens, tree.depths, uniforms.to(logprobs.device), greedy)
    else:
        choice, final = _verify_every_node(logprobs, drafts, draft_to_target, tree, greedy, uniforms, accept_rule,
                                           residual_rule)
    if fused.follow_q_path is not None:
        return Acceptance(*fused.follow_q_path(choice, final, tree.children, tree.tokens, logprobs, tree.max_depth))
    return _follow_choices(tree, logprobs, choice, final)


def _follow_choices(tree: DraftTree, logprobs, choice, final) -> Acceptance:
    """The rows' walks once every node's choice (accepted child's position, -1: none) and final token [B, N + 1]
    are known: what each node emits is its accepted child's token, or (the row stops there) its final token;
    then one gather a depth (`follow_accepted`)."""
    children = tree.children
    child_tokens = tree.tokens.gather(1, children.clamp(min=0).flatten(1)).view_as(children)
    found, picked = choice >= 0, choice.clamp(min=0)[..., None]
    node_next = torch.where(found, children.gather(2, picked)[..., 0], -1)
    node_tokens = torch.where(found, child_tokens.gather(2, picked)[..., 0], final)
    path, through, accepted = follow_accepted(node_next, tree.max_depth)
    tokens = along(through, node_tokens, -1)
    token_logprobs = along(through, logprobs.gather(2, node_tokens[..., None])[..., 0].float(), 0.0)
    return Acceptance(path, accepted, tokens, token_logprobs, accepted + 1)


def _verify_every_node(logprobs, drafts: DraftDistributions, draft_to_target, tree: DraftTree, greedy, uniforms,
                       accept_rule, residual_rule):
    """Every node's children tested and its final draw made at once: (choice, final), each [B, N + 1]."""
    batch, nodes, vocab = logprobs.shape
    children = tree.children
    child_tokens = tree.tokens.gather(1, children.clamp(min=0).flatten(1)).view_as(children)
    k, depth = children.shape[-1], tree.max_depth
    coins = uniforms.to(logprobs.device).view(batch, depth + 1, k + 1).gather(
        1, tree.depths[..., None].expand(-1, -1, k + 1))                          # a node's depth's uniforms
    node_greedy = greedy[:, None].expand(-1, nodes).reshape(-1)
    node_logprobs = logprobs.reshape(-1, vocab)
    choice, residual = _verify_children(node_logprobs, _every_draft_probs(drafts, draft_to_target, vocab),
                                        (children >= 0).reshape(-1, k), child_tokens.reshape(-1, k),
                                        coins.reshape(-1, k + 1), node_greedy, accept_rule, residual_rule, True)
    final = sample_from_logprobs(residual.log(), coins.reshape(-1, k + 1)[:, k])
    final = torch.where(node_greedy, node_logprobs.argmax(-1), final)
    return choice.view(batch, nodes), final.view(batch, nodes)


def _every_draft_probs(drafts: DraftDistributions, draft_to_target, vocab: int) -> torch.Tensor:
    """q at every node over the target vocabulary [B (N + 1), V] (zeros at a leaf)."""
    slot = drafts.slot                                                              # [B, N + 1]
    draft_vocab = drafts.dists.shape[-1]
    probs = drafts.dists.gather(1, slot.clamp(min=0)[..., None].expand(-1, -1, draft_vocab)).exp() \
        * (slot >= 0)[..., None]                                                    # [B, N + 1, Vd]
    probs = probs.reshape(-1, draft_vocab)
    if draft_to_target is None:
        return probs
    return torch.zeros(probs.shape[0], vocab, dtype=probs.dtype, device=probs.device).index_copy_(
        1, draft_to_target, probs)


def _draft_probs(drafts: DraftDistributions, rows, current, draft_to_target, vocab: int) -> torch.Tensor:
    """q at each row's current node over the target vocabulary [B, V] (zeros at a leaf)."""
    slot = drafts.slot[rows, current]
    probs = drafts.dists[rows, slot.clamp(min=0)].exp() * (slot >= 0)[:, None]    # [B, Vd]
    if draft_to_target is None:
        return probs
    return torch.zeros(probs.shape[0], vocab, dtype=probs.dtype, device=probs.device).index_copy_(
        1, draft_to_target, probs)


def _verify_children(node_logprobs, q, valid, child_tokens, coins, greedy, accept_rule, residual_rule, sync_free):
    """Recursive rejection sampling over one node's children in draw order. Returns the accepted child's
    position (-1 = none) [B] and the residual r_K [B, V] to sample from when none was accepted."""
    p = node_logprobs.exp()
    residual = p
    argmax = node_logprobs.argmax(-1)
    choice = torch.full_like(argmax, -1)
    for i in range(child_tokens.shape[1]):
        child = child_tokens[:, i:i + 1]
        q_c, r_c = q.gather(1, child)[:, 0], residual.gather(1, child)[:, 0]
        open_ = valid[:, i] & (choice < 0)
        u = 1.0 - coins[:, i]                                                      # (0, 1]
        rule = (u * q_c <= r_c) if accept_rule is None else accept_rule(u, r_c, q_c)
        drawn = open_ & (q_c > 0)                                                  # a real draw from q_i
        hit = torch.where(greedy, open_ & (child[:, 0] == argmax), drawn & rule)
        choice = torch.where(hit, torch.full_like(choice, i), choice)
        rejected = drawn & ~hit & ~greedy
        if sync_free or bool(rejected.any()):
            nxt = next_residual(residual, q) if residual_rule is None else residual_rule(residual, q)
            residual = torch.where(rejected[:, None], nxt, residual)
            q = torch.where(rejected[:, None], _without(q, child), q)
    return choice, residual


def next_residual(residual: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, r - q)); a residual with no mass left (r == q up to rounding) keeps r. Harmless: a
    rejection there has probability sum((q - r)+), the very mass that vanished (<= ~1e-7 in fp32), so whatever
    it samples moves the output law by no more (measured: TV <= 3.5e-7 with q = p + 1e-6 noise)."""
    nxt = (residual - q).clamp(min=0)
    mass = nxt.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, nxt / mass.clamp(min=1e-30), residual)


def _without(q: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """q_{i+1}: q_i with the rejected child removed, renormalized (sampling without replacement)."""
    q = q.scatter(1, token, 0.0)
    mass = q.sum(-1, keepdim=True)
    return q / mass.clamp(min=1e-30)
