"""The Python API given the wrong object, or a refused one: one clear error, and an engine left as it was.

Found by an adversarial pass over the API (2026-11-28): each of these failed deep inside torch or the engine, or
(a refused `set_drafter`) left the engine labelling samples with a drafter version that never served them."""

import json

import numpy as np
import pytest
import torch

from conftest import tiny_model
from tlt.errors import RequestError, TltError
from tlt.models.eagle import DrafterError, EagleDrafter
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.policy import PolicyError
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy

GREEDY = SamplingParams(temperature=0, max_new_tokens=6)


def test_a_refused_drafter_leaves_the_engine_serving_and_labelling_the_old_one():
    model = tiny_model("llama")
    good = EagleDrafter(model.config)
    engine = RolloutEngine(model, speculation=SpecStrategy(3, 1, 3))
    engine.set_drafter(good, version=1)
    other = EagleDrafter(tiny_model("llama", hidden_size=32, head_dim=8).config)  # another model's drafter
    with pytest.raises(DrafterError):
        engine.set_drafter(other, version=2)
    assert engine.drafter is good and engine.drafter_version == 1
    result = engine.generate([Request([5, 6, 7], params=GREEDY)])
    assert result.samples[0].drafter_versions == (1,)


@pytest.mark.parametrize("drafter", ["some/drafter/dir", "model"])
def test_a_drafter_that_is_not_one_is_refused(drafter):
    model = tiny_model("llama")
    with pytest.raises(RequestError, match="drafter must be an EagleDrafter"):
        RolloutEngine(model, drafter=model if drafter == "model" else drafter)


def test_a_model_that_is_not_one_is_refused():
    with pytest.raises(RequestError, match="model must be a transformers causal LM or a LoadedModel"):
        RolloutEngine("path/to/model")


def test_a_drafter_built_from_a_model_instead_of_its_config_is_refused():
    with pytest.raises(DrafterError, match=r"takes the target's config \(model.config\)"):
        EagleDrafter(tiny_model("llama"))


def test_a_drafter_attaches_to_a_loaded_model_too():
    from tlt.models.loading import LoadedModel

    model = tiny_model("llama")
    loaded = LoadedModel(model=model, tokenizer=None, spec=None, source="tiny")
    assert EagleDrafter(model.config).attach(loaded).target.decoder is model.model
    with pytest.raises(DrafterError, match="attaches to a transformers causal LM"):
        EagleDrafter(model.config).attach("a path")


def test_a_non_float_rollout_dtype_is_refused():
    with pytest.raises(RequestError, match="rollout dtype must be"):
        RolloutEngine(tiny_model("llama"), dtype=torch.int8)


def test_generate_takes_any_iterable_of_requests_but_not_one_request():
    engine = RolloutEngine(tiny_model("llama"))
    listed = engine.generate([Request([5, 6, 7], params=GREEDY)]).samples[0].token_ids
    generated = engine.generate(Request([5, 6, 7], params=GREEDY) for _ in range(1)).samples[0].token_ids
    assert generated == listed
    with pytest.raises(RequestError, match=r"pass \[request\]"):
        engine.generate(Request([5, 6, 7], params=GREEDY))
    with pytest.raises(RequestError, match="takes a list of Request, got int"):
        engine.generate(5)


def test_a_custom_policy_must_choose_strategies_not_names():
    model = tiny_model("llama")

    class ByName:
        def choose(self, batch_size):
            return "S3K1N3"

        def observe(self, *args, **kwargs):
            pass

        def reset(self):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

        def summary(self):
            return {}
    engine = RolloutEngine(model, drafter=EagleDrafter(model.config), speculation=ByName())
    with pytest.raises(PolicyError, match=r"ByName.choose returned 'S3K1N3': a policy returns a SpecStrategy "
                                          r"\(SpecStrategy.parse for a name\), None or 'off'"):
        engine.generate([Request([5, 6, 7], params=GREEDY)])


def test_eos_token_ids_are_checked_like_stop_token_ids():
    model = tiny_model("llama")
    assert RolloutEngine(model, eos_token_ids=3).eos_token_ids == (3,)  # one id
    assert RolloutEngine(model, eos_token_ids=[np.int64(3), 4]).eos_token_ids == (3, 4)
    with pytest.raises(RequestError, match="must be a sequence of token ids"):
        RolloutEngine(model, eos_token_ids="3")
    with pytest.raises(RequestError, match=r"\[500\] are outside the vocabulary \(0..96\)"):
        RolloutEngine(model, eos_token_ids=[500])


def test_sampling_numbers_take_numpy_floats_and_refuse_bools():
    params = SamplingParams(temperature=np.float32(0.7), top_p=np.float64(0.9))
    assert params.temperature == pytest.approx(0.7) and type(params.temperature) is float
    for bad in (dict(temperature=True), dict(top_p=True)):
        with pytest.raises(TltError):
            SamplingParams(**bad)


def test_a_run_directory_given_as_a_drafter_names_the_drafter_inside_it(tmp_path):
    """`--drafter RUN_DIR` (or a warm-up's parent directory) points at the drafter it holds (found by QA)."""
    model = tiny_model("llama")
    EagleDrafter(model.config).save(tmp_path / "run" / "final" / "drafter")
    with pytest.raises(DrafterError, match=r"is not a tlt drafter .*; did you mean .*run/final/drafter\?"):
        EagleDrafter.load(tmp_path / "run", model)
    with pytest.raises(DrafterError, match=r"is not a tlt drafter \(needs [^)]*\)$"):  # nothing inside: no hint
        EagleDrafter.load(tmp_path / "elsewhere", model)
    assert EagleDrafter.load(tmp_path / "run" / "final" / "drafter", model) is not None


@pytest.mark.parametrize("damage, named", [
    (lambda meta: "{", "not valid JSON"),
    (lambda meta: "[]", "no target_config object"),
    (lambda meta: json.dumps({"draft_vocab_size": None}), "no target_config object"),
    (lambda meta: json.dumps({**meta, "target_config": {k: v for k, v in meta["target_config"].items()
                                                        if k != "model_type"}}), "target_config has no model_type"),
    (lambda meta: json.dumps({**meta, "target_config": {**meta["target_config"], "model_type": "nope"}}),
     "model_type 'nope', which transformers does not know")])
def test_a_damaged_drafter_config_is_named_by_its_key_not_by_a_python_error(tmp_path, damage, named):
    """A hand-edited drafter_config.json was refused as "(KeyError: 'target_config')" (found by QA). Control:
    the file as saved loads."""
    model = tiny_model("llama")
    EagleDrafter(model.config).save(tmp_path)
    saved = (tmp_path / "drafter_config.json").read_text()
    (tmp_path / "drafter_config.json").write_text(damage(json.loads(saved)))
    with pytest.raises(DrafterError, match=named) as error:
        EagleDrafter.load(tmp_path, model)
    assert "Error:" not in str(error.value)
    (tmp_path / "drafter_config.json").write_text(saved)
    EagleDrafter.load(tmp_path, model)
