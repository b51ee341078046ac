"""Both acceptance rules for a chain (branching 1), all depths at once instead of a walk down the tree.

The tree walks (`acceptance.accept`, `q_sampling.accept_q`) visit one depth after another, a few dozen small
operations each; on a GPU, where a decode step is launch-bound, the walk of a 5-chain under q-sampling was ~590
operations, more than half of a verify forward's (`benchmarks/step_ops.py`). In a chain node d's only child is
node d + 1 (the root is node 0), and at every node the rule starts afresh from p (a node has one child, so no
residual carries over to a sibling): the tests of all depths are independent given the uniforms, and the walk
stops at the first failed one. So this evaluates every depth's test at once, finds the first failure j, and
draws the one final token at node j — the walk's arithmetic on the walk's uniforms, so both give the same
`Acceptance` bit for bit (tested), and the lossless tests of chains run through here.
"""

from __future__ import annotations

import torch

from tlt.sampling import sample_from_logprobs
from tlt.speculative.acceptance import Acceptance, residual_sample
from tlt.speculative.q_sampling import DraftDistributions, next_residual
from tlt.speculative.tree import DraftTree


def accept_chain(tree: DraftTree, logprobs: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor, *,
                 accept_rule=None) -> Acceptance:
    """`acceptance.accept` for a chain: child d accepted when u_d <= p_d(child) (u_d = 1 - uniforms[:, 2d]);
    at the first rejection j, a sample of p_j without the child (uniforms[:, 2j + 1]); greedy rows follow
    the argmax."""
    depth = tree.max_depth
    children, child_logprobs, argmax = _chain_children(tree, logprobs)
    child_probs = child_logprobs.exp()                                              # [B, S]
    u = 1.0 - uniforms[:, 0:2 * depth:2]
    if accept_rule is None:
        hit = u <= child_probs
    else:  # the walk's hook, called on depths flattened into rows: (u [R], cumulative [R, 1], probs [R, 1])
        flat = child_probs.reshape(-1, 1)
        hit = accept_rule(u.reshape(-1), flat, flat).reshape(u.shape)
    hit = torch.where(greedy[:, None], children == argmax[:, :depth], hit)
    stop, node_logprobs = _first_miss(hit, logprobs)
    valid = (stop < depth)[:, None]                                                 # a leaf has no child
    child = children.gather(1, stop.clamp(max=depth - 1)[:, None])
    final = residual_sample(node_logprobs, child, valid, uniforms.gather(1, 2 * stop[:, None] + 1)[:, 0], greedy,
                             argmax.gather(1, stop[:, None])[:, 0])
    return _acceptance(tree, logprobs, children, stop, final)


def accept_q_chain(tree: DraftTree, logprobs: torch.Tensor, drafts: DraftDistributions, draft_to_target,
                   greedy: torch.Tensor, uniforms: torch.Tensor, *, accept_rule=None, residual_rule=None
                   ) -> Acceptance:
    """`q_sampling.accept_q` for a chain: child d (drawn from q_d) accepted when u_d q_d(c) <= p_d(c); at the
    first rejection j, a sample of normalize(max(0, p_j - q_j)) (of p_j where no child was drawn from q, e.g.
    the leaf); greedy rows follow the argmax."""
    depth = tree.max_depth
    children, child_logprobs, argmax = _chain_children(tree, logprobs)
    draft_logq, drew = _chain_draft_logprobs(drafts, depth)                         # [B, S, Vd], [B, S]
    q_c = _draft_prob_of(draft_logq, drew, children, draft_to_target, logprobs.shape[-1])  # [B, S]
    r_c = child_logprobs.exp()
    u = 1.0 - uniforms[:, 0:2 * depth:2]
    if accept_rule is None:
        rule = u * q_c <= r_c
    else:
        rule = accept_rule(u.reshape(-1), r_c.reshape(-1), q_c.reshape(-1)).reshape(u.shape)
    drawn = q_c > 0
    hit = torch.where(greedy[:, None], children == argmax[:, :depth], drawn & rule)
    stop, node_logprobs = _first_miss(hit, logprobs)
    at_leaf = stop >= depth
    index = stop.clamp(max=depth - 1)[:, None]
    rejected = drawn.gather(1, index)[:, 0] & ~at_leaf & ~greedy
    p = node_logprobs.exp()
    q_stop = _draft_probs_at(draft_logq, drew, index, draft_to_target, p.shape[-1])
    nxt = next_residual(p, q_stop) if residual_rule is None else residual_rule(p, q_stop)
    residual = torch.where(rejected[:, None], nxt, p)
    final = sample_from_logprobs(residual.log(), uniforms.gather(1, 2 * stop[:, None] + 1)[:, 0])
    final = torch.where(greedy, argmax.gather(1, stop[:, None])[:, 0], final)
    return _acceptance(tree, logprobs, children, stop, final)


def _chain_children(tree: DraftTree, logprobs: torch.Tensor):
    """The child of nodes 0..S-1 [B, S], its log-prob under p at its parent [B, S], and p's argmax [B, S + 1]."""
    children = tree.tokens[:, 1:tree.max_depth + 1]
    child_logprobs = logprobs[:, :tree.max_depth].gather(2, children[..., None])[..., 0]
    return children, child_logprobs, logprobs.argmax(-1)


def _first_miss(hit: torch.Tensor, logprobs: torch.Tensor):
    """The first depth whose child was not accepted (S: every one was) [B], and p at that node [B, V]."""
    accepted = hit.long().cumprod(1).sum(1)
    node_logprobs = logprobs.gather(1, accepted[:, None, None].expand(-1, 1, logprobs.shape[-1]))[:, 0]
    return accepted, node_logprobs


def _chain_draft_logprobs(drafts: DraftDistributions, depth: int):
    """log q over the draft vocabulary at nodes 0..S-1 [B, S, Vd], and whether each node drew a child [B, S]."""
    slot = drafts.slot[:, :depth]
    logq = drafts.dists.gather(1, slot.clamp(min=0)[..., None].expand(-1, -1, drafts.dists.shape[-1]))
    return logq, slot >= 0


def _draft_prob_of(draft_logq, drew, tokens: torch.Tensor, draft_to_target, vocab: int) -> torch.Tensor:
    """q of each node's child [B, S] (0 for a token outside the draft vocabulary), without building q over the
    whole target vocabulary at every depth (the walk's [B, V] per depth; [B, S, V] at once would be 63 MB at
    batch 64 for SmolLM2)."""
    if draft_to_target is None:
        index, inside = tokens, drew
    else:
        to_draft = torch.full((vocab,), -1, dtype=torch.long, device=tokens.device)
        to_draft.index_copy_(0, draft_to_target, torch.arange(draft_to_target.shape[0], device=tokens.device))
        index = to_draft[tokens]
        inside = drew & (index >= 0)
    return draft_logq.gather(2, index.clamp(min=0)[..., None])[..., 0].exp() * inside


def _draft_probs_at(draft_logq, drew, index: torch.Tensor, draft_to_target, vocab: int) -> torch.Tensor:
    """q over the target vocabulary at one node per row [B, V] (index [B, 1]: the node's depth)."""
    probs = draft_logq.gather(1, index[..., None].expand(-1, -1, draft_logq.shape[-1]))[:, 0].exp() \
        * drew.gather(1, index)
    if draft_to_target is None:
        return probs
    return torch.zeros(probs.shape[0], vocab, dtype=probs.dtype, device=probs.device).index_copy_(
        1, draft_to_target, probs)


def _acceptance(tree: DraftTree, logprobs: torch.Tensor, children: torch.Tensor, accepted: torch.Tensor,
                final: torch.Tensor) -> Acceptance:
    """The walk's buffers (width S + 2, -1 / 0 padded): path 0, 1, ..., accepted; tokens: the accepted children
    then the final token; their log-probs under p at the node each was emitted from."""
    batch, width = accepted.shape[0], tree.max_depth + 2
    device = accepted.device
    positions = torch.arange(width, device=device)[None, :]
    padded = torch.cat((children, torch.full((batch, 2), -1, dtype=children.dtype, device=device)), 1)
    tokens = torch.where(positions < accepted[:, None], padded, -1)
    tokens = torch.where(positions == accepted[:, None], final[:, None], tokens)
    emitted = positions <= accepted[:, None]
    # the token at position d was emitted from node d (positions past S are never emitted)
    token_logprobs = logprobs.gather(2, tokens[:, :-1].clamp(min=0)[..., None])[..., 0].float()
    token_logprobs = torch.cat((token_logprobs, token_logprobs.new_zeros(batch, 1)), 1)
    path = torch.where(emitted, positions, -1)
    return Acceptance(path, accepted, tokens, torch.where(emitted, token_logprobs, 0.0), accepted + 1)
