"""The target-only tree rule draws its final token once, after the walk, at the node each row stopped at; the
walk it replaced drew one at every depth (as a CUDA graph must) and kept the stopping depth's. Both give the
same `Acceptance`, field for field: this keeps that walk as the reference and compares them on random trees of
odd shapes (uneven branching, leaves at every depth, rows of different shapes in one batch), greedy rows mixed
in, and the negative controls' hook. The lossless tests of trees (test_speculative_lossless.py) run through
`accept` in the engine."""

import pytest
import torch

from tlt.speculative.acceptance import Acceptance, TreeWalk, accept, residual_sample
from tlt.speculative.tree import DraftTree

VOCAB = 30


def reference_walk(tree, logprobs, greedy, uniforms, *, accept_rule=None) -> Acceptance:
    """The walk as it was (sync-free): every depth gathers its node's [B, V] log-probs and draws a residual."""
    walk = TreeWalk(logprobs.shape[0], tree.max_depth, logprobs.device)
    for step in range(tree.max_depth + 1):
        node_logprobs = logprobs[walk.rows, walk.current]
        children = tree.children[walk.rows, walk.current]
        valid = children >= 0
        child_tokens = tree.tokens.gather(1, children.clamp(min=0))
        child_probs = node_logprobs.gather(1, child_tokens).exp() * valid
        u = 1.0 - uniforms[:, 2 * step]
        cumulative = child_probs.cumsum(-1)
        hit = ((u[:, None] <= cumulative) if accept_rule is None else accept_rule(u, cumulative, child_probs)) & valid
        argmax = node_logprobs.argmax(-1)
        hit = torch.where(greedy[:, None], (child_tokens == argmax[:, None]) & valid, hit)
        found = hit.any(-1) & walk.active
        choice = hit.float().argmax(-1)
        next_node = children.gather(1, choice[:, None])[:, 0]
        emitted = child_tokens.gather(1, choice[:, None])[:, 0]
        final = residual_sample(node_logprobs, child_tokens, valid, uniforms[:, 2 * step + 1], greedy, argmax)
        emitted = torch.where(walk.active & ~found, final, emitted)
        walk.record(step, found, next_node, emitted, node_logprobs.gather(1, emitted[:, None])[:, 0])
    return walk.result()


def random_tree(seed: int, depth: int, branching: int, size: int, batch: int = 12):
    """Each row its own tree of `size` drafted nodes: every node's parent drawn among the nodes that still have
    room (depth < S, fewer than K children); siblings carry distinct tokens, as top-k drafts do."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.full((batch, size + 1), -1, dtype=torch.long)
    parents = torch.full((batch, size + 1), -1, dtype=torch.long)
    depths = torch.zeros(batch, size + 1, dtype=torch.long)
    children = torch.full((batch, size + 1, branching), -1, dtype=torch.long)
    for row in range(batch):
        tokens[row, 0] = torch.randint(0, VOCAB, (1,), generator=generator)
        count = [0] * (size + 1)
        for node in range(1, size + 1):
            open_nodes = [n for n in range(node) if depths[row, n] < depth and count[n] < branching]
            parent = open_nodes[torch.randint(0, len(open_nodes), (1,), generator=generator).item()]
            taken = {int(tokens[row, c]) for c in children[row, parent] if c >= 0}
            free = [t for t in range(VOCAB) if t not in taken]
            tokens[row, node] = free[torch.randint(0, len(free), (1,), generator=generator).item()]
            parents[row, node], depths[row, node] = parent, depths[row, parent] + 1
            children[row, parent, count[parent]] = node
            count[parent] += 1
    logits = torch.randn(batch, size + 1, VOCAB, generator=generator) * 2
    # make drafted children likely at some nodes, so rows accept 0..S of them
    for row in range(batch):
        for node in range(1, size + 1):
            if torch.rand(1, generator=generator) < 0.6:
                logits[row, parents[row, node], tokens[row, node]] += 5.0
    tree = DraftTree(tokens, parents, depths, children, depth)
    greedy = torch.rand(batch, generator=generator) < 0.3
    uniforms = torch.rand(batch, 2 * (depth + 1), generator=generator)
    return tree, logits.log_softmax(-1), greedy, uniforms


def assert_same(a, b):
    for field in ("path", "accepted", "tokens", "logprobs", "emitted"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and torch.equal(x, y), (field, x, y)


@pytest.mark.parametrize("shape", [(4, 2, 8), (3, 3, 9), (2, 4, 8), (5, 2, 6), (3, 2, 3), (1, 4, 4)],
                         ids=lambda s: "S{}K{}N{}".format(*s))
@pytest.mark.parametrize("seed", range(5))
def test_one_final_draw_equals_the_walk_drawing_at_every_depth(seed, shape):
    tree, logprobs, greedy, uniforms = random_tree(seed, *shape)
    reference = reference_walk(tree, logprobs, greedy, uniforms)
    assert_same(accept(tree, logprobs, greedy, uniforms, sync_free=True), reference)
    assert_same(accept(tree, logprobs, greedy, uniforms), reference)  # the eager walk stops early: the same


def test_rows_accept_every_depth_and_the_hook_still_biases():
    """The cases exercise rows that stop at each depth; the negative controls' biased rule reaches the walk."""
    stops = set()
    for seed in range(5):
        tree, logprobs, greedy, uniforms = random_tree(seed, 4, 2, 8)
        stops |= set(accept(tree, logprobs, greedy, uniforms).accepted.tolist())
    assert stops == {0, 1, 2, 3, 4}
    tree, logprobs, greedy, uniforms = random_tree(0, 4, 2, 8)
    biased = lambda u, cumulative, probs: u[:, None] <= cumulative * 1.5
    result = accept(tree, logprobs, greedy, uniforms, accept_rule=biased)
    assert_same(result, reference_walk(tree, logprobs, greedy, uniforms, accept_rule=biased))
    assert result.accepted.sum() > accept(tree, logprobs, greedy, uniforms).accepted.sum()
