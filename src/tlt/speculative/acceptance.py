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


def accept(tree: DraftTree, logprobs: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor,
           *, accept_rule=None, sync_free: bool = False) -> Acceptance:
    """logprobs [B, N + 1, V]: processed target log-probs at each tree node; greedy [B] bool;
    uniforms [B, 2 * (max_depth + 1)] in [0, 1) from each row's own generator, on logprobs' device.

    sync_free: never read a device value on the host (a CUDA graph): all S + 1 depths are walked and the
    residual is sampled for every row; otherwise the walk stops when no row is active (same result).
    accept_rule(u, cumulative, child_probs) -> bool [B, K] can replace the exact rule (tests use it to show
    that a biased rule is detected)."""
    batch = logprobs.shape[0]
    device = logprobs.device
    walk = TreeWalk(batch, tree.max_depth, device)
    for step in range(tree.max_depth + 1):
        node_logprobs = logprobs[walk.rows, walk.current]                          # [B, V]
        children = tree.children[walk.rows, walk.current]                         # [B, K]
        valid = children >= 0
        child_tokens = tree.tokens.gather(1, children.clamp(min=0))
        child_probs = node_logprobs.gather(1, child_tokens).exp() * valid
        u = 1.0 - uniforms[:, 2 * step]                                         # (0, 1]: u <= 0 never holds
        cumulative = child_probs.cumsum(-1)
        if accept_rule is None:
            hit = (u[:, None] <= cumulative) & valid
        else:
            hit = accept_rule(u, cumulative, child_probs) & valid
        argmax = node_logprobs.argmax(-1)
        greedy_hit = (child_tokens == argmax[:, None]) & valid
        hit = torch.where(greedy[:, None], greedy_hit, hit)
        found = hit.any(-1) & walk.active
        choice = hit.float().argmax(-1)                                           # first hit
        next_node = children.gather(1, choice[:, None])[:, 0]
        emitted = child_tokens.gather(1, choice[:, None])[:, 0]                    # accepted rows: the child
        stop = walk.active & ~found               # rejected (or childless) rows: emit from p without the children
        if sync_free or bool(stop.any()):
            final = residual_sample(node_logprobs, child_tokens, valid, uniforms[:, 2 * step + 1], greedy, argmax)
            emitted = torch.where(stop, final, emitted)
        walk.record(step, found, next_node, emitted, node_logprobs)
        if walk.finished(sync_free):
            break
    return walk.result()


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

    def record(self, step: int, found, next_node, emitted, node_logprobs) -> None:
        """Active rows emitted `emitted` at this depth; rows that `found` an accepted child move to `next_node`,
        the others stop. No host reads, no boolean-mask indexing."""
        self.tokens[:, step] = torch.where(self.active, emitted, self.tokens[:, step])
        self.logprobs[:, step] = torch.where(self.active, node_logprobs.gather(1, emitted[:, None])[:, 0],
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
