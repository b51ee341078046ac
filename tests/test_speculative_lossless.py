"""Speculative decoding is lossless: greedy identity, exact sampling distribution, and the target's log-probs.

The statistical test compares the empirical joint distribution of the first three emitted tokens with the exact
one, computable for a context-free Markov target. With n samples over cells of probability p_i,
E[TV] <= 1/2 * sum_i sqrt(p_i (1 - p_i) / n) (Jensen on each cell's binomial deviation), and TV moves by at most
1/n when one sample changes, so by McDiarmid P(TV >= E[TV] + t) <= exp(-2 n t^2). The bound below is that
expectation bound plus t for a false-alarm rate of 1e-4. The negative control runs the same test on a rule that
accepts drafted tokens too often; it must fail.
"""

import dataclasses
import functools
import itertools
import math

import pytest
import torch

from conftest import assert_logprobs_match_target, markov_model, oracle_drafter, random_prompts, tiny_model
from tlt.models.eagle import EagleDrafter
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.request import Request
from tlt.sampling import RowSampling, SamplingParams, processed_logprobs
from tlt.speculative.strategy import SpecStrategy

STRATEGIES = [SpecStrategy.chain(3), SpecStrategy(3, 2, 6), SpecStrategy(4, 3, 12)]


def run(model, requests, drafter=None, strategy=None, batch=8, tree=16):
    engine = RolloutEngine(model, max_batch_size=batch, drafter=drafter, speculation=strategy, max_tree_size=tree)
    return engine, engine.generate(requests)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_identical_with_a_random_drafter(arch, strategy, batch):
    model = tiny_model(arch)
    requests = [Request(p, n=2, params=SamplingParams(temperature=0, max_new_tokens=16))
                for p in random_prompts([3, 9, 5, 1, 12], seed=batch)]
    _, plain = run(model, requests, batch=batch)
    _, spec = run(model, requests, EagleDrafter(model.config), strategy, batch=batch)
    assert [s.token_ids for s in spec.samples] == [s.token_ids for s in plain.samples]
    assert [s.finish_reason for s in spec.samples] == [s.finish_reason for s in plain.samples]


@pytest.mark.parametrize("strategy", STRATEGIES + [SpecStrategy(5, 3, 16)], ids=str)
def test_greedy_identical_with_a_good_drafter_on_a_context_sensitive_target(strategy):
    """High acceptance exercises deep accepted paths, rollback of the rejected branches, and stop/length cuts
    inside an accepted run; the target's weak context dependence makes any mask or position error visible."""
    model, _ = markov_model(16, sharpness=3.0, context=0.05)
    params = SamplingParams(temperature=0, max_new_tokens=23, stop_token_ids=(7,))
    requests = [Request(p, n=2, params=params) for p in random_prompts([3, 9, 5, 1, 12, 6, 4], vocab_size=16)]
    _, plain = run(model, requests, batch=5)
    _, spec = run(model, requests, oracle_drafter(model), strategy, batch=5)
    assert [s.token_ids for s in spec.samples] == [s.token_ids for s in plain.samples]
    assert spec.speculation_summary()["tau"] > 2.5  # the deep paths really were taken


@pytest.mark.parametrize("top", [dict(top_k=1), dict(top_p=0.05)], ids=["topk1", "topp0.05"])
def test_greedy_rows_with_a_filter_agree_with_plain_decoding_on_tied_logits(top):
    """Every token's two likeliest successors tie exactly. Plain greedy took the raw argmax, which the row's
    top-k/top-p (ties broken by torch.topk's order) could remove (log-prob -inf); SD took the processed argmax,
    so the two decoded differently. Both must emit the same tokens, each with a finite log-prob."""
    import torch

    model, _ = markov_model(8, sharpness=1.0, seed=3)
    with torch.no_grad():
        weight = model.lm_head.weight  # the logit of b after a is sqrt(H) * weight[b, a]
        for a in range(8):
            first, second = weight[:, a].topk(2).indices
            weight[second, a] = weight[first, a]
    params = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(), **top)
    requests = [Request([a], params=params) for a in range(8)]
    _, plain = run(model, requests)
    for strategy in (SpecStrategy(3, 2, 6), SpecStrategy(3, 2, rule="q")):
        _, spec = run(model, requests, oracle_drafter(model), strategy)
        assert [s.token_ids for s in spec.samples] == [s.token_ids for s in plain.samples]
    assert all(math.isfinite(x) for result in (plain, spec) for s in result.samples for x in s.logprobs)


def exact_joint(transition, last_token, params, start=0):
    """Exact probability of every 3-token window, tokens start..start + 2 of the response, of a context-free
    Markov target."""
    vocab = transition.shape[0]
    probs = processed_logprobs(transition, RowSampling.from_params([params] * vocab, "cpu")).exp().double()
    first = probs[last_token]
    for _ in range(start):
        first = first @ probs
    return {(a, b, c): float(first[a] * probs[a, b] * probs[b, c])
            for a, b, c in itertools.product(range(vocab), repeat=3)}


def tv_and_bound(samples, exact, start=0, draws=200):
    """TV of the samples' 3-token windows from the exact law, and the bound: the null's mean + 6 SD over seeded
    draws of as many exact samples (the same bound every run). A derived bound (Jensen + McDiarmid) was ~12
    null SDs wide: acceptance 5% too generous passed it, and 20% too generous failed it by ~1 SD (found by
    review); this one fails the latter by several."""
    n = len(samples)
    counts = {}
    for sample in samples:
        key = tuple(sample.token_ids[start:start + 3])
        counts[key] = counts.get(key, 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    return tv, _null_bound(tuple(exact.values()), n, draws)


@functools.lru_cache(maxsize=None)
def _null_bound(law: tuple, n: int, draws: int) -> float:
    import torch

    probs = torch.tensor(law, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    null = torch.stack([0.5 * (torch.bincount(torch.multinomial(probs, n, replacement=True, generator=generator),
                                              minlength=len(law)).double() / n - probs).abs().sum()
                        for _ in range(draws)])
    return float(null.mean() + 6 * null.std())


SAMPLING = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
            SamplingParams(temperature=1.3, top_p=0.8)]


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "t0.7-topk4", "t1.3-topp0.8"])
@pytest.mark.parametrize("strategy", [SpecStrategy.chain(3), SpecStrategy(3, 2, 6)], ids=str)
def test_sampled_distribution_matches_the_target(params, strategy):
    model, transition = markov_model(8, sharpness=1.5, seed=1)
    settings = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                              max_new_tokens=3, stop_token_ids=(), seed=11)
    request = Request([2, 5], n=12_000, params=settings)
    engine, result = run(model, [request], oracle_drafter(model), strategy, batch=4000)
    tv, bound = tv_and_bound(result.samples, exact_joint(transition, 5, settings))
    assert tv < bound, (tv, bound)
    assert result.speculation_summary()["tau"] > 1.2  # drafts were accepted: the test exercised acceptance


@pytest.mark.parametrize("strategy,params,vocab", [
    (SpecStrategy(3, 2, 6), SamplingParams(temperature=1.0), None),
    (SpecStrategy.parse("S3K2q"), SamplingParams(temperature=1.3, top_p=0.8), [0, 2, 3, 5, 7])], ids=str)
def test_later_tokens_follow_the_target_too(strategy, params, vocab):
    """Tokens 4-6 come from the second and later SD steps: after rejections, the drafter's catch-up on the tokens
    its last step did not draft, and the tree's cache commit. The window 0-2 above sees one SD step at most
    (found by review). A noisy drafter (q != p) with a draft vocabulary: rejections and residuals happen."""
    from test_q_sampling import noisy_drafter

    model, transition = markov_model(8, sharpness=1.5, seed=1)
    drafter = noisy_drafter(model, 0.3)
    if vocab is not None:
        limited = EagleDrafter(model.config, draft_vocab=torch.tensor(vocab))
        limited.load_state_dict(drafter.state_dict(), strict=False)
        drafter = limited
    settings = dataclasses.replace(params, max_new_tokens=7, stop_token_ids=(), seed=21)
    _, result = run(model, [Request([2, 5], n=12_000, params=settings)], drafter, strategy, batch=4000)
    tv, bound = tv_and_bound(result.samples, exact_joint(transition, 5, settings, start=4), start=4)
    assert tv < bound, (tv, bound)
    assert result.speculation_summary()["sd_step_share"] > 0.6  # most tokens past the first came from SD steps


def test_plain_sampling_passes_the_same_test():
    model, transition = markov_model(8, sharpness=1.5, seed=1)
    settings = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(), seed=12)
    _, result = run(model, [Request([2, 5], n=12_000, params=settings)], batch=4000)
    tv, bound = tv_and_bound(result.samples, exact_joint(transition, 5, settings))
    assert tv < bound, (tv, bound)


def test_negative_control_a_biased_acceptance_rule_is_detected():
    model, transition = markov_model(8, sharpness=1.5, seed=1)
    settings = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(), seed=13)
    engine = RolloutEngine(model, max_batch_size=4000, drafter=oracle_drafter(model),
                           speculation=SpecStrategy(3, 2, 6), max_tree_size=8)
    engine.spec_decoder.accept_rule = lambda u, cumulative, probs: u[:, None] <= cumulative * 1.3  # accepts too often
    result = engine.generate([Request([2, 5], n=12_000, params=settings)])
    tv, bound = tv_and_bound(result.samples, exact_joint(transition, 5, settings))
    assert tv > bound, (tv, bound)
    later = dataclasses.replace(settings, max_new_tokens=7)  # the later window has the same power
    result = engine.generate([Request([2, 5], n=12_000, params=later)])
    tv, bound = tv_and_bound(result.samples, exact_joint(transition, 5, later, start=4), start=4)
    assert tv > bound, (tv, bound)


def test_returned_logprobs_are_the_targets():
    model = tiny_model("qwen2")
    params = SamplingParams(temperature=0.8, top_k=40, max_new_tokens=12, seed=3)
    requests = [Request(p, n=3, params=params) for p in random_prompts([4, 7])]
    _, result = run(model, requests, EagleDrafter(model.config), SpecStrategy(3, 2, 6), batch=6)
    assert_logprobs_match_target(model, result.samples, params)


@pytest.mark.parametrize("branching", [1, 2, 3])
def test_tree_acceptance_equals_the_target_mass_of_the_drafted_children(branching):
    """With an exact drafter, depth-1 acceptance must equal the mean top-K target probability: the tree really
    offers its K best children, in order, to the acceptance rule."""
    import torch

    model, transition = markov_model(16, sharpness=1.0, seed=1)
    top_mass = torch.softmax(transition, -1).sort(-1, descending=True).values[:, :branching].sum(-1).mean()
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(), seed=3)
    strategy = SpecStrategy(4, branching, 4 * branching)
    _, result = run(model, [Request([2, 5], n=1000, params=params)], oracle_drafter(model), strategy, batch=500,
                    tree=16)
    measured = result.speculation_summary()["acceptance_by_depth"][0]
    assert abs(measured - float(top_mass)) < 0.03, (measured, float(top_mass))


@pytest.mark.parametrize("strategy", [SpecStrategy.chain(3), SpecStrategy(3, 2, 6)], ids=str)
def test_row_admitted_mid_rollout_beside_a_row_near_its_budget(strategy):
    """A long prompt admitted late must catch the drafter up while another row is near the end of its cache:
    the catch-up pads every row to the newcomer's width (it once overflowed the drafter's KV cache)."""
    model = tiny_model("llama")
    never_stop = dict(temperature=0, stop_token_ids=())
    short, long_prompt, other = random_prompts([5, 150, 4], seed=11)
    requests = [Request(short, params=SamplingParams(max_new_tokens=200, **never_stop)),
                Request(other, params=SamplingParams(max_new_tokens=170, **never_stop)),
                Request(long_prompt, params=SamplingParams(max_new_tokens=20, **never_stop))]
    _, plain = run(model, requests, batch=2)
    _, spec = run(model, requests, EagleDrafter(model.config), strategy, batch=2)
    admitted = [t for t in spec.steps if t.kind == "prefill"]
    assert len(admitted) == 2  # the long prompt joined mid-rollout
    assert [s.token_ids for s in spec.samples] == [s.token_ids for s in plain.samples]


def test_drafter_attached_mid_rollout_to_an_engine_built_without_one():
    """set_drafter between steps of an engine that had no drafter: the running rollout's cache kept no
    features or tree slots to draft from, so it must finish plainly (rows admitted after the attach too), and
    the next generate() speculates. It once crashed (KeyError 'tokens' / a drafter without a cache)."""
    model = tiny_model("llama")
    requests = [Request(p, params=SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=()))
                for p in random_prompts([3, 9, 5, 1, 12])]
    _, plain = run(model, requests, batch=2)
    engine = RolloutEngine(model, max_batch_size=2, speculation=SpecStrategy(3, 2, 6), max_tree_size=16)
    steps = []

    def attach(e):
        steps.append(None)
        if len(steps) == 3:
            e.set_drafter(EagleDrafter(model.config))

    during = engine.generate(requests, between_steps=attach)
    after = engine.generate(requests)
    for result in (during, after):
        assert [s.token_ids for s in result.samples] == [s.token_ids for s in plain.samples]
    assert during.speculation_summary()["sd_step_share"] == 0
    assert after.speculation_summary()["sd_step_share"] == 1


def test_a_tree_reaching_past_the_context_leaves_the_batch_rope_alone():
    """A tree (and its draft) of a row near the model's context reaches positions past it. Under a dynamic RoPE
    scaling, the model's rotary embedding then rescaled its frequencies for the whole forward: every row of that
    verify step was scored with the wrong RoPE (log-probs off by ~6e-3 here, tokens from a wrong distribution)."""
    model = tiny_model("llama", max_position_embeddings=64, rope_theta=10.0,
                       rope_scaling={"rope_type": "dynamic", "factor": 32.0})
    prompts = random_prompts([50, 44, 30], seed=3)
    requests = [Request(p, n=3, params=SamplingParams(max_new_tokens=64 - len(p), stop_token_ids=(), seed=1))
                for p in prompts]
    _, result = run(model, requests, EagleDrafter(model.config), SpecStrategy(5, 2, 10), batch=9)
    assert_logprobs_match_target(model, result.samples, requests[0].params)  # params differ in budget only


@pytest.mark.parametrize("rule", ["target", "q"])
def test_a_chain_drafts_what_its_drafter_says_fed_one_pair_at_a_time(rule):
    """A chain's passes feed only the newest node over the KV the earlier passes left (a tree re-runs its
    paths): every depth's draft distribution must equal the drafter's when it is fed the committed pairs and
    then the chain's pairs one by one, committing each. A random drafter, so the draft depends on the context."""
    import torch

    from tlt.speculative.q_sampling import sampling_pick
    from tlt.speculative.tree import draft_tree, top_children

    model = tiny_model("llama", seed=3)
    drafter = EagleDrafter(model.config).attach(model)
    generator = torch.Generator().manual_seed(0)
    committed, hidden_size = 7, model.config.hidden_size
    tokens = torch.randint(0, 97, (2, committed), generator=generator)
    features = torch.randn(2, committed, hidden_size, generator=generator)
    strategy = SpecStrategy.chain(4, rule)
    settings = RowSampling.from_params([SamplingParams(temperature=1.0)] * 2, "cpu")
    pick = sampling_pick(settings, torch.rand(2, strategy.tree_size, generator=generator)) if rule == "q" \
        else top_children

    def fed(count):  # a drafter cache holding the committed pairs; the root hidden state
        rows = drafter.new_cache(2, 64).rows(0, 2)
        root = drafter.step(tokens, features, rows, torch.arange(committed).expand(2, -1))[:, -1]
        rows.advance(committed)
        return rows, root

    rows, root = fed(committed)
    candidates = draft_tree(drafter, root, rows, torch.full((2,), committed), strategy, pick)
    assert candidates.parents.tolist() == [[-1, 0, 1, 2]] * 2
    if rule == "q":  # the distribution each node's child was drawn from, keyed by that node (-1: the root)
        assert [ids.tolist() for ids, _ in candidates.expanded] == [[[-1]] * 2, [[0]] * 2, [[1]] * 2, [[2]] * 2]
    reference, hidden = fed(committed)
    for depth in range(strategy.depth):
        expected = torch.log_softmax(drafter.draft_logits(hidden), -1)
        drafted_id = candidates.tokens[:, depth]
        drafted_score = candidates.scores[:, depth] - (candidates.scores[:, depth - 1] if depth else 0)
        assert torch.allclose(drafted_score, expected.gather(1, drafted_id[:, None])[:, 0], atol=1e-5)
        if rule == "q":
            torch.testing.assert_close(candidates.expanded[depth][1][:, 0], expected, atol=1e-5, rtol=0)
        hidden = drafter.step(drafted_id[:, None], hidden[:, None], reference,
                              torch.full((2, 1), committed + depth))[:, 0]
        reference.advance(1)


@pytest.mark.parametrize("rule", ["target", "q"])
@pytest.mark.parametrize("kv_len", [None, 64], ids=["spans-from-lengths", "fixed-span"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_a_tree_drafts_what_its_drafter_says_along_each_nodes_own_path(rule, kv_len, depth):
    """A tree's passes re-run every frontier node so far under a mask that shows each only its own path (its
    slots, RoPE and mask rows made once a step: `EagleDrafter.tree_tables`). Every candidate's draft log-prob
    (and, under q-sampling, the distribution it was drawn from) must be the drafter's when fed the committed
    pairs and then that candidate's ancestors one at a time. Rows with different committed lengths."""
    import torch

    from tlt.speculative.q_sampling import sampling_pick
    from tlt.speculative.tree import draft_tree, top_children

    model = tiny_model("llama", seed=3)
    drafter = EagleDrafter(model.config).attach(model)
    generator = torch.Generator().manual_seed(1)
    lengths, hidden_size = [7, 4], model.config.hidden_size
    strategy = SpecStrategy(depth, 2, rule=rule) if rule == "q" else SpecStrategy(depth, 2, min(8, 2 * depth))
    settings = RowSampling.from_params([SamplingParams(temperature=1.0)] * 2, "cpu")
    pick = sampling_pick(settings, torch.rand(2, strategy.tree_size, generator=generator)) if rule == "q" \
        else top_children
    tokens = torch.randint(0, 97, (2, max(lengths)), generator=generator)
    features = torch.randn(2, max(lengths), hidden_size, generator=generator)

    def fed(row):  # a one-row drafter cache holding that row's committed pairs; its root hidden state
        rows = drafter.new_cache(1, 64).rows(0, 1)
        count = lengths[row]
        hidden = drafter.step(tokens[row:row + 1, :count], features[row:row + 1, :count], rows,
                              torch.arange(count)[None])[:, -1]
        rows.advance(count)
        return rows, hidden

    caches = [fed(row) for row in range(2)]
    rows = drafter.new_cache(2, 64).rows(0, 2)  # both rows, right-padded: each attends to its own pairs only
    for row in range(2):
        one = rows.cache.rows(row, 1)
        drafter.step(tokens[row:row + 1, :lengths[row]], features[row:row + 1, :lengths[row]], one,
                     torch.arange(lengths[row])[None])
        one.advance(lengths[row])
    root = torch.cat([hidden for _, hidden in caches])
    candidates = draft_tree(drafter, root, rows, torch.tensor(lengths), strategy, pick, kv_len=kv_len)
    parents = candidates.parents.tolist()
    dists = {}
    if rule == "q":
        for ids, dist in candidates.expanded:
            for row in range(2):
                for f, node in enumerate(ids[row].tolist()):
                    dists[row, node] = dist[row, f]
    for row in range(2):
        for candidate, parent in enumerate(parents[row]):
            path = []
            while parent >= 0:
                path.insert(0, parent)
                parent = parents[row][parent]
            cache, hidden = fed(row)
            for depth, node in enumerate(path):
                hidden = drafter.step(candidates.tokens[row:row + 1, node:node + 1], hidden[:, None], cache,
                                      torch.full((1, 1), lengths[row] + depth))[:, 0]
                cache.advance(1)
            expected = torch.log_softmax(drafter.draft_logits(hidden), -1)[0]
            parent = parents[row][candidate]
            score = candidates.scores[row, candidate] - (candidates.scores[row, parent] if parent >= 0 else 0)
            draft_id = int((candidates.tokens[row, candidate] == drafter.to_target_ids(
                torch.arange(expected.shape[0]))).nonzero()[0])
            assert abs(float(score - expected[draft_id])) < 1e-5, (row, candidate)
            if rule == "q":
                torch.testing.assert_close(dists[row, parent], expected, atol=1e-5, rtol=0)


def test_a_hot_swap_mid_rollout_resets_every_rows_drafter_state():
    """A swapped-in drafter must rebuild each row's drafter KV from the per-slot features, never continue from KV the
    old drafter wrote (lossless either way, but drafts from another drafter's state). Checked at the swap itself,
    with two drafters that differ, and the rollout still equals plain decoding."""
    model = tiny_model("llama")
    requests = [Request(p, params=SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=()))
                for p in random_prompts([3, 9, 5], seed=4)]
    _, plain = run(model, requests, batch=3)
    torch.manual_seed(5)
    engine = RolloutEngine(model, max_batch_size=3, drafter=EagleDrafter(model.config),
                           speculation=SpecStrategy(3, 2, 6), max_tree_size=16)
    other = EagleDrafter(model.config)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.1)
    seen = []

    def swap(e):
        seen.append(e.model_runner.spec_decoder.cache.lengths.clone())
        if len(seen) == 3:
            e.set_drafter(other)
            seen.append(e.model_runner.spec_decoder.cache.lengths.clone())

    result = engine.generate(requests, between_steps=swap)
    assert bool((seen[2] > 0).any()), seen  # the old drafter had state to drop
    assert bool((seen[3] == 0).all()), seen
    assert [s.token_ids for s in result.samples] == [s.token_ids for s in plain.samples]


def test_a_longrope_model_is_served_within_its_short_span_where_no_forward_changes_its_frequencies():
    """transformers' longrope takes its short or long factors from the longest position of a forward, not per
    position: beyond original_max_position_embeddings a row's tokens depended on its batch mates and its draft
    tree's depth (a trial found greedy SD tokens differing from plain decoding). tlt serves such a model within
    its short span: greedy SD = plain = transformers.generate beside any batch mate, and a longer request is one
    error naming the span. Control: the model's own rotary embedding does change a row's frequencies past it."""
    from tlt.errors import RequestError

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 24,
            "short_factor": [1.0] * 8, "long_factor": [1.0 + 3.0 * i for i in range(8)]}
    model = tiny_model("llama", vocab_size=30, seed=4, max_position_embeddings=96, rope_parameters=rope)
    greedy = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=())
    for seed in (4, 23):  # the trial's two prompts: one SD flipped, one a batch mate flipped
        prompt = random_prompts([16], vocab_size=30, seed=seed)[0]
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, 16:].tolist()
        mate = Request(random_prompts([18], vocab_size=30, seed=123)[0], params=greedy)
        _, alone = run(model, [Request(prompt, params=greedy)], batch=2, tree=64)
        _, beside = run(model, [Request(prompt, params=greedy), mate], batch=2, tree=64)
        _, speculative = run(model, [Request(prompt, params=greedy), mate], EagleDrafter(model.config),
                             SpecStrategy.chain(12), batch=2, tree=64)
        for out in (alone, beside, speculative):
            assert out.samples[0].token_ids == expected
    engine = RolloutEngine(model, max_batch_size=2)
    assert engine.spec.max_positions == 24
    with pytest.raises(RequestError, match=r"context of 24 tokens \(a longrope model's short span, "
                                           r"original_max_position_embeddings"):
        engine.generate([Request(random_prompts([20], vocab_size=30)[0], params=greedy)])
    from tlt.models.spec import context_positions

    # a config.json's top-level key is the span transformers builds the model with (found by review)
    settings = {"max_position_embeddings": 96, "original_max_position_embeddings": 16, "rope_parameters": rope}
    assert context_positions(settings) == 16 and context_positions({**settings, "rope_parameters": {}}) == 96
    x, row = torch.empty(0), torch.arange(16, 22)[None]
    alone_cos, _ = model.model.rotary_emb(x, row)
    batch_cos, _ = model.model.rotary_emb(x, torch.stack([row[0], torch.full((6,), 70)]))
    assert not torch.equal(alone_cos[0], batch_cos[0])
