"""Speculative sampling with the drafter's probabilities (q-sampling), chain and tree, is lossless.

Same exact-distribution test as test_speculative_lossless.py (joint law of the first three tokens of a
context-free Markov target, TV within a derived bound), run with a good drafter (q close to p but not equal),
a bad one (random: q far from p) and an exact one; two negative controls (the residual drawn from p instead of
(p - q)+, and acceptance min(1, 1.2 p/q)) must fail the same test.
"""

import pytest
import torch

from conftest import assert_logprobs_match_target, markov_model, oracle_drafter, random_prompts, tiny_model
from test_speculative_lossless import exact_joint, run, tv_and_bound
from tlt.models.eagle import EagleDrafter
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy, StrategyError

Q_STRATEGIES = [SpecStrategy.chain(3, "q"), SpecStrategy(3, 2, rule="q")]
SAMPLING = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
            SamplingParams(temperature=1.3, top_p=0.8)]


def noisy_drafter(model, noise: float, seed: int = 0):
    """The oracle drafter with its fc perturbed: q differs from p by a controlled amount."""
    drafter = oracle_drafter(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        drafter.fc.weight.add_(torch.randn(drafter.fc.weight.shape, generator=generator) * noise)
    return drafter


def sampled_tv(drafter_for, params, strategy, seed, n=12_000, rules=None):
    model, transition = markov_model(8, sharpness=1.5, seed=1)
    settings = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                              max_new_tokens=3, stop_token_ids=(), seed=seed)
    engine = RolloutEngine(model, max_batch_size=4000, drafter=drafter_for(model), speculation=strategy,
                           max_tree_size=16)
    for name, rule in (rules or {}).items():
        setattr(engine.spec_decoder, name, rule)
    result = engine.generate([Request([2, 5], n=n, params=settings)])
    tv, bound = tv_and_bound(result.samples, exact_joint(transition, 5, settings))
    return tv, bound, result.speculation_summary()


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "t0.7-topk4", "t1.3-topp0.8"])
@pytest.mark.parametrize("strategy", Q_STRATEGIES, ids=str)
@pytest.mark.parametrize("quality", ["good", "bad"])
def test_q_sampling_matches_the_target_distribution(params, strategy, quality):
    drafter = (lambda m: noisy_drafter(m, 0.2)) if quality == "good" else (lambda m: EagleDrafter(m.config))
    tv, bound, summary = sampled_tv(drafter, params, strategy, seed=21)
    assert tv < bound, (tv, bound)
    if quality == "good":
        assert summary["tau"] > 1.3  # drafts were accepted: the acceptance rule was exercised


@pytest.mark.parametrize("rules", [dict(q_residual_rule=lambda r, q: r),
                                   dict(q_accept_rule=lambda u, r_c, q_c: u * q_c <= 1.2 * r_c)],
                         ids=["residual-from-p", "accept-1.2p-over-q"])
@pytest.mark.parametrize("strategy", Q_STRATEGIES, ids=str)
def test_negative_controls_fail_the_same_test(rules, strategy):
    tv, bound, _ = sampled_tv(lambda m: noisy_drafter(m, 0.6), SAMPLING[0], strategy, seed=22, rules=rules)
    assert tv > bound, (tv, bound)


@pytest.mark.parametrize("strategy", [SpecStrategy.chain(4, "q"), SpecStrategy(3, 2, rule="q")], ids=str)
def test_an_exact_drafter_is_always_accepted(strategy):
    """q = p: min(1, p/q) = 1 for the first child of every node, so a chain emits depth + 1 tokens every step
    (the target-only rule accepts only with probability p(child)). In a tree the accepted depth-2 node is a
    leaf when it is not among the K best-scored nodes expanded at depth 3."""
    model, _ = markov_model(8, sharpness=1.5, seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=13, stop_token_ids=(), seed=4)
    engine = RolloutEngine(model, max_batch_size=64, drafter=oracle_drafter(model), speculation=strategy,
                           max_tree_size=16)
    result = engine.generate([Request([2, 5], n=64, params=params)])
    acceptance = result.speculation_summary()["acceptance_by_depth"]
    expanded_everywhere = strategy.depth if strategy.branching == 1 else 2
    assert acceptance[:expanded_everywhere] == [1.0] * expanded_everywhere
    target_only = RolloutEngine(model, max_batch_size=64, drafter=oracle_drafter(model),
                                speculation=SpecStrategy(strategy.depth, strategy.branching, strategy.tree_size),
                                max_tree_size=16).generate([Request([2, 5], n=64, params=params)])
    assert target_only.speculation_summary()["acceptance_by_depth"][0] < 0.9


@pytest.mark.parametrize("strategy", Q_STRATEGIES + [SpecStrategy(4, 3, rule="q")], ids=str)
@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_identical_to_plain_decoding(arch, strategy, batch):
    model = tiny_model(arch)
    requests = [Request(p, n=2, params=SamplingParams(temperature=0, max_new_tokens=16))
                for p in random_prompts([3, 9, 5, 1], seed=batch)]
    _, plain = run(model, requests, batch=batch)
    _, spec = run(model, requests, EagleDrafter(model.config), strategy, batch=batch, tree=40)
    assert [s.token_ids for s in spec.samples] == [s.token_ids for s in plain.samples]


def test_mixed_batch_greedy_rows_stay_exact_and_logprobs_are_the_targets():
    """Greedy and sampled rows (with their own top-k / top-p) share every q-sampling step."""
    model = tiny_model("qwen2")
    prompts = random_prompts([4, 7, 5], seed=3)
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    sampled = [SamplingParams(temperature=0.8, top_k=40, max_new_tokens=12, seed=3),
               SamplingParams(temperature=1.2, top_p=0.9, max_new_tokens=12, seed=4)]
    requests = [Request(prompts[0], n=2, params=greedy)] + [Request(p, n=2, params=s)
                                                            for p, s in zip(prompts[1:], sampled)]
    _, plain = run(model, requests[:1], batch=6)
    _, spec = run(model, requests, EagleDrafter(model.config), SpecStrategy(3, 2, rule="q"), batch=6, tree=16)
    assert [s.token_ids for s in spec.samples[:2]] == [s.token_ids for s in plain.samples]
    for params, index in zip(sampled, (1, 2)):
        assert_logprobs_match_target(model, [s for s in spec.samples if s.request_index == index], params)


def test_drafting_uses_a_draft_vocabulary():
    """A drafter over a subset of the vocabulary: q is mapped back to target ids (index_copy) and stays exact."""
    model, transition = markov_model(8, sharpness=1.5, seed=1)
    subset = torch.tensor([0, 2, 3, 5, 7])
    settings = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(), seed=23)

    def drafter(m):
        d = EagleDrafter(m.config, draft_vocab=subset)
        d.load_state_dict(noisy_drafter(m, 0.3).state_dict(), strict=False)
        return d

    engine = RolloutEngine(model, max_batch_size=4000, drafter=drafter(model), speculation=SpecStrategy(3, 2, rule="q"),
                           max_tree_size=16)
    result = engine.generate([Request([2, 5], n=12_000, params=settings)])
    tv, bound = tv_and_bound(result.samples, exact_joint(transition, 5, settings))
    assert tv < bound, (tv, bound)
    assert result.speculation_summary()["tau"] > 1.2


def test_strategy_names_and_parsing():
    assert SpecStrategy.parse("S4K2q") == SpecStrategy(4, 2, 14, "q") and SpecStrategy(4, 2, rule="q").name == "S4K2N14q"
    assert SpecStrategy.parse("S4K2N14q").rule == "q" and SpecStrategy.parse("S4K2N8") == SpecStrategy(4, 2, 8)
    assert SpecStrategy.chain(3, "q").tree_size == 3
    for bad in ("S4K2", "S4K2N8q", "4K2N8", "S0K1N1"):
        with pytest.raises(StrategyError):
            SpecStrategy.parse(bad)
    # non-integer sizes once failed mid-rollout inside torch (torch.rand, topk) instead of here
    for bad in (dict(depth=2.0), dict(depth="3"), dict(depth=3, branching=True), dict(depth=3, tree_size=3.0)):
        with pytest.raises(StrategyError, match="integers"):
            SpecStrategy(**bad)
