"""Bad rollout input gets one clear error naming the problem, never a torch stack trace."""

import pytest

from conftest import tiny_model
from tlt.errors import RequestError
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.request import Request
from tlt.rollout.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return RolloutEngine(tiny_model("llama", max_position_embeddings=64), max_batch_size=4)


def test_empty_prompt():
    with pytest.raises(RequestError, match="empty prompt"):
        Request([])


@pytest.mark.parametrize("n", [0, -2, 1.5])
def test_invalid_n(n):
    with pytest.raises(RequestError, match="n \\(samples per prompt\\)"):
        Request([5], n=n)


def test_prompt_longer_than_the_context(engine):
    with pytest.raises(RequestError, match="exceeds the model's context of 64"):
        engine.generate([Request([5] * 70, params=SamplingParams(max_new_tokens=1))])


def test_prompt_plus_budget_longer_than_the_context_is_not_truncated(engine):
    with pytest.raises(RequestError, match="60 tokens \\+ max_new_tokens 10"):
        engine.generate([Request([5] * 60, params=SamplingParams(max_new_tokens=10))])


def test_token_ids_out_of_vocabulary(engine):
    with pytest.raises(RequestError, match="out of range"):
        engine.generate([Request([5, 97])])


def test_no_requests_and_wrong_types(engine):
    with pytest.raises(RequestError, match="no requests"):
        engine.generate([])
    with pytest.raises(RequestError, match="expected tlt Request"):
        engine.generate([[5, 6]])


def test_invalid_batch_size():
    with pytest.raises(RequestError, match="max_batch_size"):
        RolloutEngine(tiny_model(), max_batch_size=0)


def test_strategy_larger_than_the_reserved_tree_slots():
    from tlt.models.eagle import EagleDrafter
    from tlt.speculative.strategy import SpecStrategy, StrategyError

    model = tiny_model()
    engine = RolloutEngine(model, drafter=EagleDrafter(model.config), speculation=SpecStrategy(4, 3, 20),
                           max_tree_size=8)
    with pytest.raises(RequestError, match="max_tree_size"):
        engine.generate([Request([5, 6], params=SamplingParams(max_new_tokens=4))])
    with pytest.raises(StrategyError, match="tree_size"):
        SpecStrategy(3, 1, 5)
