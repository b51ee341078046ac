"""The processed distribution matches transformers' warpers; draws follow it and never pick removed tokens."""

import dataclasses
import math

import pytest
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from tlt.errors import RequestError
from tlt.sampling import (RowSampling, SamplingParams, processed_logprobs, sample_from_logprobs,
                                  sample_next)


def hf_processed(logits, temperature, top_k, top_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.log_softmax(scores, dim=-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 10, 0.6), (1.0, 1, 1.0), (2.0, 0, 0.05)])
def test_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = processed_logprobs(logits, RowSampling.from_params([params] * 4, "cpu"))
    ref = hf_processed(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    assert (ours[finite] - ref[finite]).abs().max() < 1e-5


def test_rows_use_their_own_settings():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(top_k=3), SamplingParams(temperature=0.5, top_p=0.5)]
    ours = processed_logprobs(logits, RowSampling.from_params(params, "cpu"))
    assert torch.isfinite(ours[0]).sum() == 3
    ref = hf_processed(logits[1:], 0.5, 0, 0.5)[0]
    assert torch.equal(torch.isinf(ours[1]), torch.isinf(ref))
    assert (ours[1][torch.isfinite(ref)] - ref[torch.isfinite(ref)]).abs().max() < 1e-5


def test_inverse_cdf_draws_follow_the_distribution_and_skip_removed_tokens():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.3])
    logprobs = probs.log().expand(200_000, -1)
    uniforms = torch.rand(200_000, generator=torch.Generator().manual_seed(3))
    counts = torch.bincount(sample_from_logprobs(logprobs, uniforms), minlength=5).double() / 200_000
    assert counts[1] == 0 and counts[3] == 0
    # 5 standard errors of a binomial proportion at n = 200k is < 0.006
    assert (counts - probs.double()).abs().max() < 5 * math.sqrt(0.25 / 200_000)
    assert sample_from_logprobs(probs.log()[None], torch.tensor([0.9999999]))[0] == 4


@pytest.mark.parametrize("vocab", [5, 256, 700])
def test_the_blocked_cdf_draws_the_one_level_cdfs_tokens(vocab):
    """A vocabulary of one block draws from one CDF, a larger one from block sums then within a block: both are
    the textbook inverse CDF over the whole vocabulary (a float64 cumsum, searched), token for token but for
    uniforms within rounding of a boundary. Rows with removed tokens, a removed first and last token, a whole
    removed block; uniforms 0 and 1 - 2^-40 take the first and the last token of positive probability."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=generator) * 3
    logits[::3, ::2] = float("-inf")
    logits[1::4, 0] = logits[1::4, -1] = float("-inf")
    if vocab > 256:
        logits[2::4, 256:512] = float("-inf")
    logprobs = torch.log_softmax(logits, -1).repeat(50, 1)
    uniforms = torch.rand(logprobs.shape[0], generator=generator, dtype=torch.float64)
    uniforms[:64], uniforms[64:128] = 0.0, 1 - 2 ** -40
    cdf = logprobs.exp().cumsum(-1, dtype=torch.float64)
    reference = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    drawn = sample_from_logprobs(logprobs, uniforms)
    assert bool(torch.isfinite(logprobs.gather(1, drawn[:, None])).all())  # never a removed token
    assert int((drawn != reference).sum()) <= 2
    positive = torch.isfinite(logprobs[:64])
    assert torch.equal(drawn[:64], positive.int().argmax(-1))
    assert torch.equal(drawn[64:128], vocab - 1 - positive.flip(-1).int().argmax(-1))


def test_greedy_rows_take_the_argmax_and_report_untempered_logprob():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    rows = RowSampling.from_params([SamplingParams(temperature=0), SamplingParams(temperature=0)], "cpu")
    tokens, logprobs = sample_next(logits, rows, torch.tensor([0.01, 0.99]))
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_greedy_rows_take_a_token_their_filter_keeps_when_the_top_logits_tie():
    """torch.topk may keep the later of two tied tokens: a greedy row with top-k 1 then took the raw argmax
    (the earlier one) and reported log-prob -inf for a token its own processed distribution had removed."""
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    logits[:, [2, 5]] = logits.max() + 1  # a two-way tie at the top of every row
    rows = RowSampling.from_params([SamplingParams(temperature=0, top_k=1)] * 4, "cpu")
    tokens, logprobs = sample_next(logits, rows, torch.full((4,), 0.5))
    assert set(tokens.tolist()) <= {2, 5} and logprobs.tolist() == [0.0] * 4


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1), dict(max_new_tokens=0)])
def test_invalid_sampling_values_are_rejected(bad):
    with pytest.raises(RequestError) as error:
        SamplingParams(**bad)
    assert next(iter(bad)) in str(error.value)


def test_a_vanishing_temperature_is_refused_not_crashed_on():
    """temperature=1e-39 passed validation; logits / T overflowed to inf, the processed log-probs were NaN and
    the inverse-CDF draw returned token 255 of a 97-token vocabulary (an IndexError in the engine)."""
    with pytest.raises(RequestError, match="use 0 for greedy"):
        SamplingParams(temperature=1e-39)
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


@pytest.mark.parametrize("scale,top_k,top_p", [(0.1, 0, 0.95), (8.0, 0, 0.9), (1.0, 3000, 0.97), (0.5, 700, 1.0)])
def test_large_vocabulary_nucleus_search_is_exact(scale, top_k, top_p):
    """Flat rows force the candidate set to widen (to a full sort); peaked rows stop at the first 256."""
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(4)) * scale
    ours = processed_logprobs(logits, RowSampling.from_params([SamplingParams(top_k=top_k, top_p=top_p)] * 3, "cpu"))
    ref = hf_processed(logits, 1.0, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    assert (ours[finite] - ref[finite]).abs().max() < 1e-4


MIXED_SETTINGS = [SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_p=0.7), SamplingParams(top_k=300),
                  SamplingParams(temperature=0.5, top_k=40, top_p=0.9), SamplingParams(temperature=0),
                  SamplingParams(temperature=1.7, top_p=0.99), SamplingParams(top_k=1)]


@pytest.mark.parametrize("vocab", [10, 600])
def test_each_row_in_a_mixed_batch_matches_its_own_reference(vocab):
    """Continuous batching mixes rows with different settings: none may inherit another row's top-k or top-p."""
    generator = torch.Generator().manual_seed(5)
    for trial in range(20):
        picks = torch.randint(0, len(MIXED_SETTINGS), (4,), generator=generator).tolist()
        params = [MIXED_SETTINGS[i] for i in picks]
        logits = torch.randn(4, vocab, generator=generator) * 2
        ours = processed_logprobs(logits, RowSampling.from_params(params, "cpu"))
        for row, p in enumerate(params):
            ref = hf_processed(logits[row:row + 1], p.temperature or 1.0, min(p.top_k, vocab), p.top_p)[0]
            assert torch.equal(torch.isinf(ours[row]), torch.isinf(ref)), (trial, params)
            finite = torch.isfinite(ref)
            assert (ours[row][finite] - ref[finite]).abs().max() < 1e-5


def test_unfiltered_row_keeps_the_whole_vocabulary_beside_a_top_k_row():
    """The issue's repro: a plain row next to a top_k=3 row kept only 3 tokens."""
    rows = RowSampling.from_params([SamplingParams(), SamplingParams(top_k=3)], "cpu")
    ours = processed_logprobs(torch.randn(2, 10, generator=torch.Generator().manual_seed(6)), rows)
    assert torch.isfinite(ours[0]).sum() == 10 and torch.isfinite(ours[1]).sum() == 3


def test_mixed_batch_draws_follow_each_rows_distribution():
    """Draws through sample_next in a mixed batch: the plain row samples tokens outside the other row's top-k."""
    logits = torch.randn(10, generator=torch.Generator().manual_seed(7)).expand(2, -1).contiguous()
    rows = RowSampling.from_params([SamplingParams(), SamplingParams(top_k=2)], "cpu")
    uniforms = torch.rand(2000, 2, generator=torch.Generator().manual_seed(8))
    tokens = torch.stack([sample_next(logits, rows, u)[0] for u in uniforms])
    top2 = set(logits[0].topk(2).indices.tolist())
    assert set(tokens[:, 1].tolist()) <= top2
    probs = torch.softmax(logits[0], -1)
    plain = torch.bincount(tokens[:, 0], minlength=10).double() / 2000
    assert (plain - probs.double()).abs().max() < 5 * math.sqrt(0.25 / 2000)
    assert not set(tokens[:, 0].tolist()) <= top2


FILTERED_SETTINGS = MIXED_SETTINGS + [SamplingParams(top_k=2**70, top_p=0.8), SamplingParams(top_k=4000, top_p=0.999),
                                      SamplingParams(temperature=3.0, top_p=0.97)]


@pytest.mark.parametrize("vocab,scale", [(10, 2.0), (600, 2.0), (5000, 0.1), (5000, 8.0), (49152, 1.0)])
def test_the_sync_free_filter_keeps_the_candidate_searchs_sets(vocab, scale):
    """A CUDA graph sorts the whole vocabulary (no host read) where the eager path widens a candidate set until
    it holds the nucleus: the same kept set and log-probs for every row of mixed batches, peaked and flat (the
    search widening to a full sort), with a k past the vocabulary."""
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(6):
        picks = torch.randint(0, len(FILTERED_SETTINGS), (6,), generator=generator).tolist()
        rows = RowSampling.from_params([FILTERED_SETTINGS[i] for i in picks], "cpu")
        logits = torch.randn(6, vocab, generator=generator) * scale
        searched = processed_logprobs(logits, rows)
        sorted_ = processed_logprobs(logits, dataclasses.replace(rows, sync_free=True))
        assert torch.equal(searched.isinf(), sorted_.isinf()), (trial, picks)
        torch.testing.assert_close(sorted_, searched, rtol=0, atol=1e-5)


def test_the_sync_free_filter_comparison_can_fail():
    """Negative control: a nucleus that keeps its boundary token one step early (mass, not mass before the token,
    compared with top_p) is caught by the comparison above."""
    from tlt import sampling

    logits = torch.randn(6, 600, generator=torch.Generator().manual_seed(600)) * 2.0
    rows = RowSampling.from_params([SamplingParams(top_p=0.7)] * 6, "cpu")
    searched = processed_logprobs(logits, rows)
    original = sampling._outside_the_nucleus
    try:
        sampling._outside_the_nucleus = lambda probs, mass, rank, top_p, nucleus: original(
            probs, mass + probs, rank, top_p, nucleus)
        early = processed_logprobs(logits, dataclasses.replace(rows, sync_free=True))
    finally:
        sampling._outside_the_nucleus = original
    assert not torch.equal(searched.isinf(), early.isinf())


@pytest.mark.parametrize("sync_free", [False, True], ids=["searched", "sorted"])
def test_tied_tokens_are_kept_by_lowest_id_whatever_the_other_rows_ask(sync_free):
    """torch.topk returns an arbitrary member of a tie, and how many candidates it fetches depends on the whole
    batch (the largest top-k, 256 for any top-p row): the kept set must not (a review found a greedy top_k=1 row
    changing tokens beside a top_p row, vocabularies over 256 only)."""
    from tlt.sampling import filter_top_k_top_p

    vocab = 600
    row = torch.full((vocab,), -5.0)
    tied = torch.tensor([452, 59, 337, 120])
    row[tied] = 3.0                                    # a 4-way exact tie at the top
    row[[7, 8]] = 1.0                                  # and one below it
    expected = {1: [59], 2: [59, 120], 5: [7, 59, 120, 337, 452]}
    for k, kept in expected.items():
        for other_k, other_p in ((0, 0.9), (300, 1.0), (0, 1.0), (599, 0.5)):
            scaled = torch.stack([row, torch.randn(vocab)])
            out = filter_top_k_top_p(scaled, torch.tensor([k, other_k]), torch.tensor([1.0, other_p]),
                                     sync_free=sync_free)
            assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == kept, (k, other_k, other_p)
    # a nucleus that ends inside a tie keeps its lowest ids too: the 4 tied tokens have 0.224 each
    out = filter_top_k_top_p(torch.stack([row, row, row]), torch.tensor([0, 0, 300]), torch.tensor([0.4, 0.6, 1.0]),
                             sync_free=sync_free)
    assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == [59, 120]
    assert torch.isfinite(out[1]).nonzero()[:, 0].tolist() == [59, 120, 337]


def test_a_subset_of_a_filtered_batch_without_filters_is_sampled_not_crashed_on():
    """select() keeps its parent's flags (an over-approximation the class allows): a subset in which no row filters
    must sample as the unfiltered rows it holds (it crashed on an empty candidate set)."""
    built = RowSampling.from_params([SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=3),
                                     SamplingParams()], "cpu")
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2))
    subset = built.select(torch.tensor([2]))
    assert subset.any_filtered  # the parent's flag: the case under test
    torch.testing.assert_close(processed_logprobs(logits, subset), torch.log_softmax(logits, -1))
    tokens, _ = sample_next(logits, subset, torch.tensor([0.5]))
    assert 0 <= int(tokens[0]) < 50


def test_a_top_k_beyond_any_long_keeps_the_vocabulary():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    rows = RowSampling.from_params([SamplingParams(top_k=2**70), SamplingParams(top_k=2)], "cpu")
    kept = processed_logprobs(logits, rows).isfinite().sum(-1).tolist()
    assert kept == [50, 2]


def test_a_nan_row_draws_an_in_vocabulary_token_with_a_nan_logprob():
    """No index past the vocabulary (on CUDA a device-side assert); the NaN log-prob is what the engine refuses."""
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 1.0, 2.0]])
    tokens, logprobs = sample_next(logits, RowSampling.from_params([SamplingParams()] * 2, "cpu"),
                                   torch.tensor([0.5, 0.5]))
    assert 0 <= int(tokens[0]) < 3 and math.isnan(float(logprobs[0])) and math.isfinite(float(logprobs[1]))
