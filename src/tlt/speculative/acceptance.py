"""Target-only tree speculative sampling: every emitted token is an exact sample of the target.

At the current node (first the root) with processed target distribution p and children c_1..c_m in draft order:
draw u ~ U(0, 1]; accept the first child with u <= p(c_1) + ... + p(c_i) and move to it; if none is accepted,
emit a sample from p with c_1..c_m removed and renormalized, and stop. A child is thus emitted with probability
p(c_i) and any other token t with probability (1 - sum_j p(c_j)) * p(t) / (1 - sum_j p(c_j)) = p(t): the emitted
token is distributed exactly as p, whatever the drafter proposed. An accepted leaf continues the same way with
no children, i.e. emits a "bonus" token sampled from p. Greedy rows follow the target's argmax instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.sampling import sample_from_logprobs
from tlt.speculative.tree import DraftTree


@dataclass
class Acceptance:
    path: torch.Tensor          # [B, S + 1] tree node indices, root first then the accepted nodes, -1 padded
    accepted: torch.Tensor      # [B] accepted draft nodes (not counting the root)
    tokens: torch.Tensor        # [B, S + 1] emitted tokens: accepted nodes' tokens then the final token, -1 padded
    logprobs: torch.Tensor      # [B, S + 1] the target's processed log-prob of each emitted token
    emitted: torch.Tensor       # [B] = accepted + 1
    packed: torch.Tensor | None = None  # `decoder.pack` of the above, when a kernel wrote it with them


def accept(tree: DraftTree, logprobs: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor,
           *, accept_rule=None, sync_free: bool = False) -> Acceptance:
    """logprobs [B, N + 1, V]: processed target log-probs at each tree node; greedy [B] bool;
    uniforms [B, 2 * (max_depth + 1)] in [0, 1) from each row's own generator, on logprobs' device.

    The walk down the tree reads only each node's children ([B, K] tables made once for all nodes), and the one
    final token is drawn after it, at the node each row stopped at, from uniforms[:, 2 * depth + 1]: a draw from
    p without the children is [B, V] work, which a walk drawing at every depth (as a CUDA graph must, not knowing
    where rows stop) paid S + 1 times.
    sync_free: never read a device value on the host (a CUDA graph): all S + 1 depths are walked; otherwise
    the walk stops when no row is active (same result).
    accept_rule(u, cumulative, child_probs) -> bool [B, K] can replace the exact rule (tests use it to show
    that a biased rule is detected)."""
    if sync_free:
        return _accept_every_node(tree, logprobs, greedy, uniforms, accept_rule)
    children, child_tokens, child_logprobs, argmax = _child_tables(tree, logprobs)
    walk = TreeWalk(logprobs.shape[0], tree.max_depth, logprobs.device)
    for step in range(tree.max_depth + 1):
        at = (walk.rows, walk.current)
        node_children, tokens, node_argmax, node_child_logprobs = children[at], child_tokens[at], argmax[at], \
            child_logprobs[at]
        valid = node_children >= 0
        child_probs = node_child_logprobs.exp() * valid
        u = 1.0 - uniforms[:, 2 * step]                                         # (0, 1]: u <= 0 never holds
        cumulative = child_probs.cumsum(-1)
        if accept_rule is None:
            hit = (u[:, None] <= cumulative) & valid
        else:
            hit = accept_rule(u, cumulative, child_probs) & valid
        greedy_hit = (tokens == node_argmax[:, None]) & valid
        hit = torch.where(greedy[:, None], greedy_hit, hit)
        found = hit.any(-1) & walk.active
        choice = hit.float().argmax(-1)[:, None]                                  # first hit
        # a row that stops here records its chosen child too: `_put_final_tokens` puts the final token over it
        walk.record(step, found, node_children.gather(1, choice)[:, 0], tokens.gather(1, choice)[:, 0],
                    node_child_logprobs.gather(1, choice)[:, 0])
        if walk.finished(sync_free):
            break
    _put_final_tokens(tree, logprobs, child_tokens, argmax, greedy, uniforms, walk.current, walk.accepted,
                      walk.tokens, walk.logprobs)
    return walk.result()


def _child_tables(tree: DraftTree, logprobs):
    """Every node's children [B, N + 1, K] (-1 padded), their tokens and target log-probs, and the target's
    argmax at every node [B, N + 1]: what both walks read."""
    children = tree.children
    child_tokens = tree.tokens.gather(1, children.clamp(min=0).flatten(1)).view_as(children)
    return children, child_tokens, logprobs.gather(2, child_tokens), logprobs.argmax(-1)


def _accept_every_node(tree: DraftTree, logprobs, greedy, uniforms, accept_rule) -> Acceptance:
    """`accept` for a CUDA graph, which walks every depth: each node's test runs for all nodes at once, on the
    uniforms of its depth (the walk reaches a node at the step equal to its depth), over [B, N + 1, K]; then
    `follow_accepted` chases the accepted children, one gather per depth, where the walk spent ~30 operations
    a depth. The same arithmetic per node: the same `Acceptance` (tested against the walk)."""
    children, child_tokens, child_logprobs, argmax = _child_tables(tree, logprobs)
    k = children.shape[-1]
    valid = children >= 0
    child_probs = child_logprobs.exp() * valid
    cumulative = child_probs.cumsum(-1)
    u = 1.0 - uniforms.gather(1, 2 * tree.depths)                                   # (0, 1], each node's depth's
    if accept_rule is None:
        hit = (u[..., None] <= cumulative) & valid
    else:  # as the walk calls it: u [rows], cumulative and child_probs [rows, K]
        hit = accept_rule(u.reshape(-1), cumulative.reshape(-1, k), child_probs.reshape(-1, k)).view_as(valid) & valid
    hit = torch.where(greedy[:, None, None], (child_tokens == argmax[..., None]) & valid, hit)
    choice = hit.float().argmax(-1, keepdim=True)                                   # first hit
    node_next = torch.where(hit.any(-1), children.gather(2, choice)[..., 0], -1)
    path, through, accepted = follow_accepted(node_next, tree.max_depth)
    tokens = along(through, child_tokens.gather(2, choice)[..., 0], -1)            # the accepted children's
    token_logprobs = along(through, child_logprobs.gather(2, choice)[..., 0], 0.0).float()
    _put_final_tokens(tree, logprobs, child_tokens, argmax, greedy, uniforms, path.gather(1, accepted[:, None])[:, 0],
                      accepted, tokens, token_logprobs)
    return Acceptance(path, accepted, tokens, token_logprobs, accepted + 1)


def follow_accepted(node_next: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's walk from the root once each node's accepted child is known: node_next [B, N + 1] (-1: none,
    the row stops there). Returns (path [B, S + 2]: the root, then the accepted nodes, -1 padded; the same with
    a sink node N + 1 in place of -1, for `along`; the accepted count [B]). A stopped row moves to the sink,
    which leads to itself: one gather of a [B, 1] pointer per depth, nothing read on the host."""
    batch, nodes = node_next.shape
    table = torch.cat([node_next.masked_fill(node_next < 0, nodes), node_next.new_full((batch, 1), nodes)], 1)
    current = node_next.new_zeros(batch, 1)
    steps = [current]
    for _ in range(max_depth + 1):
        current = table.gather(1, current)
        steps.append(current)
    through = torch.cat(steps, 1)
    path = through.masked_fill(through == nodes, -1)
    return path, through, (path[:, 1:] >= 0).sum(1)


def along(through: torch.Tensor, values: torch.Tensor, fill) -> torch.Tensor:
    """values [B, N + 1] (one per node) at each step of the paths `follow_accepted` returned, `fill` past their
    end."""
    return torch.cat([values, values.new_full((values.shape[0], 1), fill)], 1).gather(1, through)


def _put_final_tokens(tree: DraftTree, logprobs, child_tokens, argmax, greedy, uniforms, stop_node, accepted,
                      tokens, token_logprobs) -> None:
    """Each row's final token, at the node it stopped at (stop_node [B]; its depth: its accepted count), written
    into tokens / token_logprobs at that position: a sample of p without that node's children, or p's argmax
    for a greedy row."""
    at = (torch.arange(stop_node.shape[0], device=stop_node.device), stop_node)
    stop = accepted[:, None]
    node_logprobs = logprobs[at]                                                    # [B, V]
    final = residual_sample(node_logprobs, child_tokens[at], tree.children[at] >= 0,
                            uniforms.gather(1, 2 * stop + 1)[:, 0], greedy, argmax[at])
    tokens.scatter_(1, stop, final[:, None])
    token_logprobs.scatter_(1, stop, node_logprobs.gather(1, final[:, None]).to(token_logprobs.dtype))


class TreeWalk:
    """Every row's walk down the tree, all starting at the root, shared by both acceptance rules: the current
    node, whether the row is still walking, and what it emitted (buffers sized for max_depth + 1 emissions)."""

    def __init__(self, batch: int, max_depth: int, device):
        self.rows = torch.arange(batch, device=device)
        self.current = torch.zeros(batch, dtype=torch.long, device=device)
        self.active = torch.ones(batch, dtype=torch.bool, device=device)
        self.path = torch.full((batch, max_depth + 2), -1, dtype=torch.long, device=device)
        self.path[:, 0].fill_(0)
        self.tokens = torch.full((batch, max_depth + 2), -1, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(batch, max_depth + 2, device=device)
        self.accepted = torch.zeros(batch, dtype=torch.long, device=device)

    def record(self, step: int, found, next_node, emitted, emitted_logprobs) -> None:
        """Active rows emitted `emitted` (log-prob under p at their node `emitted_logprobs`) at this depth; rows
        that `found` an accepted child move to `next_node`, the others stop. No host reads, no boolean-mask
        indexing."""
        self.tokens[:, step] = torch.where(self.active, emitted, self.tokens[:, step])
        self.logprobs[:, step] = torch.where(self.active, emitted_logprobs.to(self.logprobs.dtype),
                                             self.logprobs[:, step])
        self.path[:, step + 1] = torch.where(found, next_node, self.path[:, step + 1])
        self.accepted += found.long()
        self.active = found
        self.current = torch.where(found, next_node, self.current)

    def finished(self, sync_free: bool) -> bool:
        """Whether every row stopped (read on the host: never inside a graph, which walks every depth)."""
        return not sync_free and not bool(self.active.any())

    def result(self) -> Acceptance:
        return Acceptance(self.path, self.accepted, self.tokens, self.logprobs, self.accepted + 1)


def residual_sample(logprobs, child_tokens, valid, uniforms, greedy, argmax) -> torch.Tensor:
    """Sample from p with the rejected children removed (renormalized); greedy rows emit the argmax."""
    removed = torch.zeros_like(logprobs)
    removed.scatter_add_(1, child_tokens.clamp(min=0), valid.to(logprobs.dtype))  # pads add 0: no effect
    residual = logprobs.masked_fill(removed > 0, -float("inf"))
    empty = torch.isinf(residual).all(-1, keepdim=True)  # all mass was on the children (float rounding only)
    sampled = sample_from_logprobs(torch.where(empty, logprobs, residual), uniforms)
    return torch.where(greedy, argmax, sampled)
