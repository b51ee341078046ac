"""The chain fast paths give what the tree code gives: both acceptance rules the walk's `Acceptance`, field for
field, and a chain's tree the general selection's tree and mask.

Random chains, target distributions that accept some children and reject others, greedy rows mixed in, a
draft vocabulary (children outside it have q = 0), and the hooks the negative controls use. The lossless
tests of chains (test_speculative_lossless.py, test_q_sampling.py) run through the fast path in the engine."""

import pytest
import torch

from tlt.speculative.acceptance import accept
from tlt.speculative.chain_acceptance import accept_chain, accept_q_chain
from tlt.speculative.q_sampling import DraftDistributions, accept_q
from tlt.speculative.strategy import SpecStrategy
from tlt.speculative.tree import Candidates, DraftTree, _best_tree, select_tree

VOCAB, DRAFT_VOCAB = 40, 24


def chain_case(seed: int, depth: int, batch: int = 16, draft_vocab: bool = True):
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=generator)
    draft_to_target = torch.randperm(VOCAB, generator=generator)[:DRAFT_VOCAB].sort().values if draft_vocab \
        else None
    pool = draft_to_target if draft_vocab else torch.arange(VOCAB)
    tokens = pool[torch.randint(0, len(pool), (batch, depth + 1), generator=generator)]
    tokens[::5, 2 % (depth + 1)] = (torch.arange(VOCAB)[~torch.isin(torch.arange(VOCAB), pool)][:1]
                                    if draft_vocab else tokens[::5, 0])  # some children outside the draft vocab
    logits = torch.randn(batch, depth + 1, VOCAB, generator=generator) * 2
    # make the drafted child likely at some nodes, so rows accept 0..S children
    boost = (rand(batch, depth) < 0.7) * 6.0
    logits[:, :depth].scatter_add_(2, tokens[:, 1:, None], boost[..., None])
    logprobs = logits.log_softmax(-1)
    nodes = torch.arange(depth + 1)
    children = torch.where(nodes < depth, nodes + 1, -1)[None, :, None].expand(batch, -1, -1).clone()
    tree = DraftTree(tokens, (nodes - 1)[None].expand(batch, -1).clone(), nodes[None].expand(batch, -1).clone(),
                     children, depth)
    q_logits = torch.randn(batch, depth, DRAFT_VOCAB if draft_vocab else VOCAB, generator=generator)
    drafts = DraftDistributions(q_logits.log_softmax(-1), torch.where(nodes < depth, nodes, -1)[None].expand(
        batch, -1).clone())
    greedy = rand(batch) < 0.3
    uniforms = rand(batch, 2 * (depth + 1))
    return tree, logprobs, drafts, draft_to_target, greedy, uniforms


def assert_same(a, b):
    for field in ("path", "accepted", "tokens", "logprobs", "emitted"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and torch.equal(x, y), (field, x, y)


@pytest.mark.parametrize("depth", [1, 3, 5])
@pytest.mark.parametrize("seed", range(6))
def test_target_only_chain_equals_the_walk(seed, depth):
    tree, logprobs, _, _, greedy, uniforms = chain_case(seed, depth)
    fast = accept_chain(tree, logprobs, greedy, uniforms)
    assert_same(accept(tree, logprobs, greedy, uniforms), fast)
    assert_same(accept(tree, logprobs, greedy, uniforms, sync_free=True), fast)
    assert 0 < fast.accepted.float().mean() < depth  # both accepting and rejecting rows were exercised


@pytest.mark.parametrize("draft_vocab", [True, False])
@pytest.mark.parametrize("depth", [1, 3, 5])
@pytest.mark.parametrize("seed", range(6))
def test_q_chain_equals_the_walk(seed, depth, draft_vocab):
    tree, logprobs, drafts, mapping, greedy, uniforms = chain_case(seed, depth, draft_vocab=draft_vocab)
    fast = accept_q_chain(tree, logprobs, drafts, mapping, greedy, uniforms)
    assert_same(accept_q(tree, logprobs, drafts, mapping, greedy, uniforms), fast)
    assert_same(accept_q(tree, logprobs, drafts, mapping, greedy, uniforms, sync_free=True), fast)


def test_the_hooks_reach_the_fast_path():
    """The negative controls' biased rules change the fast path's result exactly as they change the walk's."""
    tree, logprobs, drafts, mapping, greedy, uniforms = chain_case(7, 4)
    for biased in (lambda u, cumulative, probs: u[:, None] <= cumulative * 1.3,
                   lambda u, cumulative, probs: torch.ones_like(cumulative, dtype=torch.bool)):
        fast = accept_chain(tree, logprobs, greedy, uniforms, accept_rule=biased)
        assert_same(accept(tree, logprobs, greedy, uniforms, accept_rule=biased), fast)
    assert torch.equal(fast.accepted, torch.where(greedy, fast.accepted, 4))  # every sampled row took all 4
    assert not torch.equal(fast.accepted, accept_chain(tree, logprobs, greedy, uniforms).accepted)
    rules = dict(accept_rule=lambda u, r_c, q_c: u * q_c <= 1.2 * r_c, residual_rule=lambda r, q: r)
    fast = accept_q_chain(tree, logprobs, drafts, mapping, greedy, uniforms, **rules)
    assert_same(accept_q(tree, logprobs, drafts, mapping, greedy, uniforms, **rules), fast)


@pytest.mark.parametrize("rule", ["target", "q"])
@pytest.mark.parametrize("depth", [1, 2, 5])
def test_a_chains_tree_is_the_general_selection(depth, rule):
    generator = torch.Generator().manual_seed(depth)
    batch = 3
    candidates = Candidates(torch.randint(0, VOCAB, (batch, depth), generator=generator),
                            torch.rand(batch, depth, generator=generator).log().cumsum(1),
                            torch.arange(-1, depth - 1).expand(batch, -1), [])
    root = torch.randint(0, VOCAB, (batch,), generator=generator)
    strategy = SpecStrategy.chain(depth, rule)
    fast, general = select_tree(root, candidates, strategy), _best_tree(root, candidates, strategy)
    assert fast.chain and not general.chain
    for field in ("tokens", "parents", "depths", "children"):
        assert torch.equal(getattr(fast, field), getattr(general, field)), field
    assert torch.equal(fast.attention(), general.attention())
    assert fast.max_depth == general.max_depth == depth


@pytest.mark.parametrize("strategy", [SpecStrategy(1, 3, rule="q"), SpecStrategy(3, 2, rule="q"),
                                      SpecStrategy(4, 3, rule="q"), SpecStrategy(3, 2, 10), SpecStrategy(2, 3, 12)],
                         ids=str)
def test_a_whole_tree_is_the_general_selection(strategy):
    """Every candidate kept (q trees always, a target tree at its largest size): the children tables come from
    the expansions' order instead of a sort and a ranking, and must be what the general selection builds."""
    from test_acceptance_exactness import BigramDrafter
    from tlt.sampling import RowSampling, SamplingParams
    from tlt.speculative.q_sampling import sampling_pick
    from tlt.speculative.tree import draft_tree

    generator = torch.Generator().manual_seed(strategy.depth * 10 + strategy.branching)
    batch, vocab = 64, 7
    drafter = BigramDrafter(torch.randn(vocab, vocab, generator=generator) * 2)
    root_tokens = torch.randint(0, vocab, (batch,), generator=generator)
    committed = torch.zeros(batch, dtype=torch.long)
    pick = {}
    if strategy.rule == "q":
        settings = RowSampling.from_params([SamplingParams(temperature=1.0)] * batch, "cpu")
        pick = dict(pick=sampling_pick(settings, torch.rand(batch, strategy.tree_size, generator=generator)))
    candidates = draft_tree(drafter, root_tokens.float()[:, None], None, committed, strategy, **pick)
    whole, general = select_tree(root_tokens, candidates, strategy), _best_tree(root_tokens, candidates, strategy)
    for field in ("tokens", "parents", "depths", "children"):
        assert torch.equal(getattr(whole, field), getattr(general, field)), field
    assert torch.equal(whole.attention(), general.attention())
    assert whole.max_depth == general.max_depth == strategy.depth
