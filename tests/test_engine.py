"""RolloutEngine: greedy == transformers generate, continuous batching, seeds, stop tokens, log-probs, trace."""

import pytest
import torch

from conftest import EOS, assert_logprobs_match_target, random_prompts, tiny_model
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams


def hf_greedy(model, prompt, max_new_tokens, eos=EOS):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("max_batch_size", [1, 3, 16])
def test_greedy_equals_transformers_generate(arch, max_batch_size):
    model = tiny_model(arch)
    engine = RolloutEngine(model, max_batch_size=max_batch_size)
    prompts = random_prompts([3, 9, 5, 1, 12, 6, 4])
    params = SamplingParams(temperature=0, max_new_tokens=20)
    result = engine.generate([Request(p, n=2, params=params) for p in prompts])
    assert len(result.samples) == 14
    for sample in result.samples:
        assert sample.token_ids == hf_greedy(model, list(sample.prompt_ids), 20)
        expected = "stop" if sample.token_ids[-1] == EOS else "length"
        assert sample.finish_reason == expected


def test_eos_and_stop_tokens_end_responses():
    model = tiny_model("llama", vocab_size=8)  # tiny vocabulary: EOS shows up quickly when sampling
    engine = RolloutEngine(model, max_batch_size=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=0)
    result = engine.generate([Request([5, 6, 7], n=32, params=params)])
    stopped = [s for s in result.samples if s.finish_reason == "stop"]
    assert stopped and all(s.token_ids[-1] == EOS and EOS not in s.token_ids[:-1] for s in stopped)
    assert all(len(s.token_ids) == 40 for s in result.samples if s.finish_reason == "length")
    custom = SamplingParams(temperature=1.0, max_new_tokens=40, seed=0, stop_token_ids=(6,))
    for sample in engine.generate([Request([5, 7], n=16, params=custom)]).samples:
        assert sample.finish_reason == "length" or sample.token_ids[-1] == 6
        assert 6 not in sample.token_ids[:-1]


def test_seeded_sampling_is_reproducible_and_seed_sensitive():
    model = tiny_model("qwen2")
    engine = RolloutEngine(model, max_batch_size=5)
    prompts = random_prompts([4, 7, 2])

    def run(seed):
        params = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, max_new_tokens=15, seed=seed)
        return [s.token_ids for s in engine.generate([Request(p, n=3, params=params) for p in prompts]).samples]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_samples_of_one_prompt_differ_and_do_not_depend_on_batching():
    model = tiny_model("llama")
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    requests = [Request(p, n=4, params=params) for p in random_prompts([5, 8])]
    wide = RolloutEngine(model, max_batch_size=8).generate(requests)
    narrow = RolloutEngine(model, max_batch_size=3).generate(requests)
    assert len({tuple(s.token_ids) for s in wide.samples[:4]}) > 1
    assert [s.token_ids for s in wide.samples] == [s.token_ids for s in narrow.samples]


def test_logprobs_are_those_of_the_processed_distribution():
    model = tiny_model("qwen3")
    engine = RolloutEngine(model, max_batch_size=4)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8, seed=1)
    result = engine.generate([Request(p, n=2, params=params) for p in random_prompts([6, 3])])
    assert_logprobs_match_target(model, result.samples, params)


def test_trace_shows_continuous_batching_and_the_draining_tail():
    model = tiny_model("llama")
    engine = RolloutEngine(model, max_batch_size=4)
    lengths = [2, 30, 3, 4, 25, 2, 5, 3]
    requests = [Request(p, n=1, params=SamplingParams(temperature=0, max_new_tokens=n, stop_token_ids=()))
                for p, n in zip(random_prompts([4] * 8), lengths)]
    result = engine.generate(requests)
    assert [len(s.token_ids) for s in result.samples] == lengths
    decode_batches = result.batch_size_trace()
    assert max(decode_batches) == 4
    assert decode_batches[-1] == 1  # the longest response finishes alone: the long tail
    prefills = [s for s in result.steps if s.kind == "prefill"]
    assert len(prefills) > 1  # queued requests joined as rows freed up
    assert sum(s.new_tokens for s in result.steps) == sum(lengths)
    assert all(s.wall_s > 0 for s in result.steps)


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=4, seed=0),
                                    SamplingParams(top_p=0.9, top_k=5, max_new_tokens=4, seed=0),
                                    SamplingParams(temperature=0, max_new_tokens=4)], ids=["t1", "filtered", "greedy"])
def test_a_policy_with_nan_weights_is_refused_not_sampled_from(params, speculative):
    """A diverged policy's NaN logits gave an index error (sampled rows), token 0 forever (greedy rows) or
    plausible tokens (filtered rows): every row now stops the rollout with one clear error."""
    from tlt.errors import NonFiniteError
    from tlt.models.eagle import EagleDrafter
    from tlt.speculative.strategy import SpecStrategy

    model = tiny_model("llama", seed=1)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")  # every later activation is NaN
    spec = SpecStrategy(3, 2, rule="q") if speculative else None
    engine = RolloutEngine(model, max_batch_size=2, drafter=EagleDrafter(model.config) if speculative else None,
                           speculation=spec, max_tree_size=16)
    with pytest.raises(NonFiniteError, match="non-finite logits"):
        engine.generate([Request([5, 6, 7], params=params)])
