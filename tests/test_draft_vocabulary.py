"""The draft vocabulary of a drafter trained from scratch, and an untrained drafter serving no speculative step."""

import pytest
from conftest import markov_model, oracle_drafter
from tlt.drafter.vocabulary import frequent_tokens, limits_vocab
from tlt.rl.config import ConfigError, load_config
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy


def test_frequent_tokens_rank_by_count_then_id_and_top_up_with_the_lowest_ids():
    sequences = [[9, 9, 9, 4, 4, 7], [7, 4, 12]]
    assert frequent_tokens(sequences, 3, 20).tolist() == [4, 7, 9]       # 4 and 9 three times, 7 twice
    assert frequent_tokens(sequences, 6, 20).tolist() == [0, 1, 4, 7, 9, 12]
    assert frequent_tokens([], 3, 20).tolist() == [0, 1, 2]


def test_stop_tokens_are_always_in_the_vocabulary_and_never_twice():
    sequences = [[9, 9, 4, 4, 7]]
    # the stop token 15 never occurs in the sequences, yet a drafter must be able to propose it
    assert frequent_tokens(sequences, 3, 20, always=[15]).tolist() == [4, 9, 15]
    assert frequent_tokens(sequences, 3, 20, always=[9, 9]).tolist() == [4, 7, 9]
    assert frequent_tokens(sequences, 2, 20, always=[99, -1]).tolist() == [4, 9]  # ids outside the vocabulary


@pytest.mark.parametrize("size, limits", [(0, False), (3, True), (19, True), (20, False), (50, False)])
def test_a_vocabulary_as_large_as_the_models_is_the_whole_one(size, limits):
    assert limits_vocab(size, 20) is limits


@pytest.mark.parametrize("value, message", [
    (2, r"run.draft_vocab must be 0 \(the whole vocabulary\) or at least 3"),
    (-1, r"run.draft_vocab must be 0"),
])
def test_a_draft_vocabulary_narrower_than_a_node_is_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"run.draft_vocab={value}"])


def test_the_widest_strategy_sets_the_floor():
    with pytest.raises(ConfigError, match="at least 4"):
        load_config(None, ["run.strategy=S2K4N8", "run.draft_vocab=3"])
    assert load_config(None, ["run.draft_vocab=0"]).run.draft_vocab == 0


def _sd_steps(trained: bool) -> int:
    model, _ = markov_model(16, seed=3)
    engine = RolloutEngine(model, max_batch_size=4, speculation=SpecStrategy.chain(3), eos_token_ids=[])
    engine.set_drafter(oracle_drafter(model), version=0, trained=trained)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)
    result = engine.generate([Request([1, 2, 3], params=params, n=2)])
    assert all(len(sample.token_ids) == 12 for sample in result.samples)
    return sum(1 for step in result.steps if step.kind == "decode" and step.mode == "sd")


def test_an_untrained_drafter_serves_no_step_and_a_trained_one_does():
    """A drafter at its random initialization is accepted at chance (τ ≈ 1): every speculative step would cost
    more than a plain one. The same engine and drafter, marked trained, speculates (the control)."""
    assert _sd_steps(trained=False) == 0
    assert _sd_steps(trained=True) > 0


def test_a_step_line_says_when_speculation_waits_for_a_trained_drafter():
    from tlt.distributed.run import _speculation_text

    assert _speculation_text({"sd/sd_step_share": 0.0}, 0, given_drafter=False) == "SD waits for a trained drafter"
    assert _speculation_text({"sd/sd_step_share": 0.0}, 0, given_drafter=True) == "SD in 0% of decode steps"
    assert _speculation_text({"sd/sd_step_share": 0.25, "sd/tau": 1.5}, 3, given_drafter=False) == \
        "SD in 25% of decode steps, τ 1.50"
    assert _speculation_text({"sd/sd_step_share": 0.0, "sd/gate": 0}, 0, given_drafter=True).startswith(
        "SD off: no arm pays on this device")


def test_the_warm_up_drafts_over_its_responses_tokens_and_the_stop_tokens():
    """`tlt drafter warmup` takes a new drafter's vocabulary from its responses; the stop token is in it even
    when no response reached it."""
    from tlt.drafter.buffer import FeatureBuffer
    from tlt.drafter.trainer import DrafterTrainConfig
    from tlt.drafter.warmup import WarmupConfig, new_trainer
    from tlt.models import LoadedModel, ModelSpec
    from tlt.models.lean_forward import LeanForward
    from tlt.tasks.synthetic import IdTokenizer

    model, _ = markov_model(16, seed=3)
    loaded = LoadedModel(model, IdTokenizer(eos_token_id=13), ModelSpec.from_config(model.config), "markov")
    responses = [[5, 5, 6, 6, 7], [5, 8]]
    trainer = new_trainer(loaded, None, None, LeanForward(model), responses, FeatureBuffer(1000),
                          WarmupConfig(draft_vocab=5), DrafterTrainConfig())
    # the stop tokens (the model config's 3, the tokenizer's 13), then 5 and 6, then 7 (tied with 8: lower id)
    assert trainer.drafter.draft_to_target.tolist() == [3, 5, 6, 7, 13]
