"""Equal-work replay: every sample decodes exactly its recorded length, stop tokens ignored, in every mode."""

import pytest
from conftest import random_prompts, tiny_model
from test_distributed import EOS, RUNNER, STOPPER, long_tail_model, make_controller

from tlt.errors import RequestError, TltError
from tlt.models.eagle import EagleDrafter
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.replay import length_matched, regroup
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy


def requests_of(prompts, n=3, max_new_tokens=24):
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=7)
    return [Request(p, n=n, params=params) for p in prompts]


def test_one_request_per_sample_with_its_length_and_no_stop_tokens():
    requests = requests_of(random_prompts([4, 6]))
    replayed = length_matched(requests, [1, 5, 24, 3, 3, 30])
    assert [r.n for r in replayed] == [1] * 6
    assert [r.params.max_new_tokens for r in replayed] == [1, 5, 24, 3, 3, 30]
    assert all(r.params.stop_token_ids == () and r.params.temperature == 1.0 for r in replayed)
    assert [r.prompt_ids for r in replayed] == [requests[0].prompt_ids] * 3 + [requests[1].prompt_ids] * 3


@pytest.mark.parametrize("lengths,expected", [([1, 2], "one length per sample: 6 samples, 2 lengths"),
                                              ([1, 2, 3, 4, 5, 0], "sample 5 must be an integer >= 1"),
                                              ([1, 2, 3, 4, 5, 2.5], "sample 5 must be an integer >= 1")])
def test_bad_replay_lengths(lengths, expected):
    with pytest.raises(RequestError, match=expected):
        length_matched(requests_of(random_prompts([4, 6])), lengths)


@pytest.mark.parametrize("speculative", [False, True])
def test_every_sample_decodes_exactly_its_length_past_eos(speculative):
    model = long_tail_model()  # after STOPPER it emits EOS at once; after anything else it never ends
    drafter = {"drafter": EagleDrafter(model.config), "speculation": SpecStrategy(3, 1, 3)} if speculative else {}
    engine = RolloutEngine(model, eos_token_ids=[EOS], **drafter)
    requests = requests_of([[9, 10, STOPPER], [9, 10, RUNNER]])
    natural = engine.generate(requests)
    assert [len(s.token_ids) for s in natural.samples][:3] == [1, 1, 1]  # the stopper's samples end at EOS
    lengths = [6, 1, 17, 2, 24, 9]
    result = regroup(engine.generate(length_matched(requests, lengths)), requests)
    assert [len(s.token_ids) for s in result.samples] == lengths
    assert all(s.finish_reason == "length" for s in result.samples)
    assert result.samples[0].token_ids[0] == EOS  # EOS was sampled and did not end the sample
    assert [(s.request_index, s.sample_index) for s in result.samples] == [(0, 0), (0, 1), (0, 2),
                                                                         (1, 0), (1, 1), (1, 2)]
    if speculative:
        assert any(step.mode == "sd" for step in result.steps)


def test_a_replay_is_reproducible_and_its_samples_have_their_own_streams():
    model = tiny_model()
    engine = RolloutEngine(model)
    requests = requests_of(random_prompts([5]), n=4, max_new_tokens=12)
    replay = length_matched(requests, [12, 12, 12, 12])
    first, second = engine.generate(replay), engine.generate(replay)
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in second.samples]
    assert len({tuple(s.token_ids) for s in first.samples}) == 4


def test_replayed_rl_steps_decode_the_recorded_lengths_in_every_mode(tmp_path):
    """The benchmark's loop in small: a natural step records lengths; off and static SD replay them."""
    fast = {"rollout.max_new_tokens": 24}
    reference = make_controller(tmp_path / "reference", **fast, **{"run.speculative": "off"})
    try:
        reference.train_step()
        lengths = [len(s.token_ids) for s in reference.last_rollout.samples]
    finally:
        reference.close()
    assert lengths[:4] == [1, 1, 1, 1] and max(lengths) == 24  # ShortLongTask: 2 short prompts, 2 long
    lengths = [3, 1, 7, 2, 24, 11, 5, 16]  # not the natural ones: EOS must be ignored, budgets obeyed
    for mode in ("off", "static"):
        controller = make_controller(tmp_path / mode, **fast, **{"run.speculative": mode})
        try:
            metrics = controller.train_step(lengths=lengths)
            assert [len(s.token_ids) for s in controller.last_rollout.samples] == lengths
            assert metrics["response_len_max"] == 24
            with pytest.raises(TltError, match="one length per sample: 8 samples, 3 lengths"):
                controller.train_step(lengths=[1, 2, 3])
        finally:
            controller.close()
