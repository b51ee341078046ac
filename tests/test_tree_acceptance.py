"""Tree acceptance without per-depth [B, V] work, field for field the walk's `Acceptance`.

The target-only rule draws its final token once, after the walk, at the node each row stopped at; the walk it
replaced drew one at every depth (as a CUDA graph must) and kept the stopping depth's: this keeps that walk as
the reference. Under q-sampling a graph runs every node's sibling tests at once, then follows the accepted
children; the eager walk (which stops early) is the reference. Random trees of odd shapes (uneven branching,
leaves at every depth, rows of different shapes in one batch), greedy rows mixed in, a draft vocabulary, and
the negative controls' hooks. The lossless tests of trees (test_speculative_lossless.py, test_q_sampling.py)
run through both paths in the engine."""

import pytest
import torch

from tlt.speculative.acceptance import Acceptance, TreeWalk, accept, residual_sample
from tlt.speculative.q_sampling import DraftDistributions, accept_q
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


def draft_distributions(tree, logprobs, seed: int, draft_vocab: bool):
    """q at every node with children: near p at some nodes (so q-sampling accepts), far at others; over a draft
    vocabulary of 20 of the 30 tokens when asked (children outside it have q = 0)."""
    generator = torch.Generator().manual_seed(seed + 100)
    batch, nodes, vocab = logprobs.shape
    mapping = torch.randperm(vocab, generator=generator)[:20].sort().values if draft_vocab else None
    near = torch.rand(batch, nodes, 1, generator=generator) < 0.5
    logits = torch.where(near, logprobs + 0.3 * torch.randn(batch, nodes, vocab, generator=generator),
                         torch.randn(batch, nodes, vocab, generator=generator))
    dists = (logits if mapping is None else logits[..., mapping]).log_softmax(-1)
    slot = torch.where((tree.children >= 0).any(-1), torch.arange(nodes), -1)
    uniforms = torch.rand(batch, (tree.max_depth + 1) * (tree.children.shape[-1] + 1), generator=generator)
    return DraftDistributions(dists, slot), mapping, uniforms


@pytest.mark.parametrize("draft_vocab", [True, False])
@pytest.mark.parametrize("shape", [(4, 2, 14), (3, 3, 12), (2, 4, 8), (5, 2, 6), (1, 4, 4)],
                         ids=lambda s: "S{}K{}N{}".format(*s))
@pytest.mark.parametrize("seed", range(4))
def test_q_sampling_every_node_at_once_equals_the_walk(seed, shape, draft_vocab):
    tree, logprobs, greedy, _ = random_tree(seed, *shape)
    drafts, mapping, uniforms = draft_distributions(tree, logprobs, seed, draft_vocab)
    walk = accept_q(tree, logprobs, drafts, mapping, greedy, uniforms)
    assert_same(accept_q(tree, logprobs, drafts, mapping, greedy, uniforms, sync_free=True), walk)


def test_q_sampling_cases_stop_at_every_depth_and_the_hooks_reach_every_node():
    """The cases exercise rows stopping at each depth; each negative control's hook (an over-accepting rule, a
    residual that is p again instead of (p - q)+) changes what both paths emit, and changes it alike."""
    stops, changed = set(), {"accept_rule": False, "residual_rule": False}
    biased = {"accept_rule": lambda u, r, q: u * q <= 2.0 * r, "residual_rule": lambda r, q: r}
    for seed in range(4):
        tree, logprobs, greedy, _ = random_tree(seed, 4, 2, 14)
        drafts, mapping, uniforms = draft_distributions(tree, logprobs, seed, True)
        exact = accept_q(tree, logprobs, drafts, mapping, greedy, uniforms, sync_free=True)
        stops |= set(exact.accepted.tolist())
        for name, hook in biased.items():
            result = accept_q(tree, logprobs, drafts, mapping, greedy, uniforms, sync_free=True, **{name: hook})
            assert_same(result, accept_q(tree, logprobs, drafts, mapping, greedy, uniforms, **{name: hook}))
            changed[name] |= not torch.equal(result.tokens, exact.tokens)
    assert stops == {0, 1, 2, 3, 4} and all(changed.values()), (stops, changed)
