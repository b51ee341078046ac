"""The draft vocabulary of a drafter trained from scratch, and an untrained drafter serving no speculative step."""

from pathlib import Path

import pytest
import torch

from conftest import markov_model, oracle_drafter, tiny_model
from test_distributed import long_tail_model, make_controller
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


@pytest.mark.parametrize("overrides, message", [
    (["run.draft_vocab=2"], r"run.draft_vocab must be 0 \(the whole vocabulary\) or at least 3"),
    (["run.draft_vocab=-1"], r"run.draft_vocab must be >= 0"),
    (["run.strategy=S2K4N8", "run.draft_vocab=3"], "at least 4"),
    (["run.speculative=static", "run.strategy=S4K2N8", "run.draft_vocab=1"], "at least 2"),
])
def test_a_draft_vocabulary_narrower_than_a_node_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides", [["run.draft_vocab=0"], ["run.speculative=static", "run.strategy=S3K1N3",
                                                                "run.draft_vocab=1"],
                                       ["run.speculative=off", "run.draft_vocab=1"],
                                       ["run.drafter=drafters/x", "run.draft_vocab=1"]])
def test_a_draft_vocabulary_is_checked_only_where_a_drafter_from_scratch_uses_it(overrides):
    assert load_config(None, overrides).run.draft_vocab in (0, 1)


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


def test_a_step_line_says_when_speculation_waited_for_a_trained_drafter():
    from tlt.distributed.run import _speculation_text

    waiting = {"sd/sd_step_share": 0.0, "drafter_trained": False}
    assert _speculation_text(waiting) == "SD waited for a trained drafter"
    assert _speculation_text({**waiting, "drafter_trained": True}) == "SD in 0% of decode steps"
    assert _speculation_text({"sd/sd_step_share": 0.25, "sd/tau": 1.5, "drafter_trained": True}) == \
        "SD in 25% of decode steps, τ 1.50"
    assert _speculation_text({**waiting, "sd/gate": 0}).startswith("SD off: no arm pays on this device")


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


def test_token_ids_given_as_tensors_count_as_their_values_and_ids_outside_the_vocabulary_are_skipped():
    """A task's prompt_ids may return a tensor (the rollout accepts one): 0-d tensors hash by identity, so each
    occurrence counted apart and the vocabulary repeated ids (the drafter refused it at start-up)."""
    as_tensors = [list(torch.tensor([5, 5, 6, 7, 5]))]
    assert frequent_tokens(as_tensors, 2, 10).tolist() == [5, 6]
    assert frequent_tokens([[99, -3, 6, 6]], 2, 10).tolist() == [0, 6]


class FewRecords:
    """A task given in code over a few records, drawing without replacement as one naturally writes it."""

    def __init__(self, records: int = 20, fail: bool = False):
        from tlt.tasks.example import TaskExample

        self.examples = [TaskExample(f"p{i}", "x", {"ids": [9, i % 12]}) for i in range(records)]
        self.fail = fail

    def sample(self, count, seed):
        import random

        if self.fail:
            raise RuntimeError("the prompt service is down")
        return random.Random(seed).sample(self.examples, count)

    def prompt_ids(self, example):
        return example.meta["ids"]


def test_a_task_given_in_code_is_asked_for_its_usual_draws_and_its_failure_does_not_stop_the_run(caplog):
    """It was asked for 512 prompts at once (a task of 20 records raised "sample larger than population" and the
    run could not start); a failing draw leaves the stop tokens and the lowest ids, with a warning."""
    from tlt.rl.replica import _prompt_token_ids

    drawn = _prompt_token_ids(FewRecords())
    assert drawn and all(ids[0] == 9 for ids in drawn)
    with caplog.at_level("WARNING", logger="tlt.rl.replica"):
        assert _prompt_token_ids(FewRecords(fail=True)) == []
    assert "sampling the task's prompts failed (RuntimeError: the prompt service is down)" in caplog.text


@pytest.mark.parametrize("given", [False, True])
def test_every_drivers_engine_holds_back_an_untrained_drafter(tmp_path, given):
    """The rule was the distributed worker's alone: the in-process GRPOTrainer speculated every step with the
    random drafter (τ 1.0)."""
    from test_trainer import make_trainer
    from tlt.models.eagle import EagleDrafter

    overrides = {"run.speculative": "static", "run.strategy": "S3K1N3", "run.gate": 64}
    if given:
        EagleDrafter(tiny_model("llama", vocab_size=16).config).save(tmp_path / "drafter")
        overrides["run.drafter"] = str(tmp_path / "drafter")
    else:
        overrides.update({"run.workers": 2})  # (a drafter from scratch needs a trainer in the config)
    trainer = make_trainer(tmp_path / "run", **overrides)
    assert trainer.engine.drafter_trained is given
    metrics = trainer.train_step()
    assert (metrics["sd/sd_step_share"] > 0) is given


def test_the_cost_curves_cache_key_knows_the_draft_vocabulary():
    """A curve measured with a whole-vocabulary drafter priced the 8,192-token one (3.2x cheaper drafting)."""
    from tlt.models.eagle import EagleDrafter
    from tlt.rollout.cost_curve import curve_key

    model, _ = markov_model(16, seed=3)
    arms = [SpecStrategy.chain(3)]
    keys = {curve_key(RolloutEngine(model, drafter=EagleDrafter(model.config, vocab)), arms, (1, 2))
            for vocab in (None, torch.arange(8), torch.arange(1, 9))}
    assert len(keys) == 2  # the whole vocabulary, and 8 tokens (which 8 does not change the cost)


def test_the_cost_curves_cache_key_knows_a_qwen3_targets_drafter_layer():
    """A curve measured with a Qwen3-layer drafter (two q/k norm kernels a pass more) must not price a new Qwen3
    target's drafter, whose layer is Llama's."""
    from conftest import tiny_model
    from tlt.models.eagle import EagleDrafter
    from tlt.rollout.cost_curve import curve_key

    arms = [SpecStrategy.chain(3)]
    qwen3 = tiny_model("qwen3")
    keys = {curve_key(RolloutEngine(qwen3, drafter=EagleDrafter(qwen3.config, layer=layer)), arms, (1, 2))
            for layer in (None, "qwen3")}
    assert len(keys) == 2


def test_the_step_line_of_a_real_run_says_speculation_waited(tmp_path, monkeypatch):
    """The line `tlt train` prints, from a run whose drafter never trained (its trainer fails), and from the
    same run once trained versions serve."""
    import io

    from rich.console import Console

    from tlt.distributed.run import train
    from tlt.drafter.trainer import DrafterTrainer

    def lines(directory, **overrides):
        output = io.StringIO()
        controller = make_controller(directory, **{"run.steps": 2, **overrides})
        try:
            train(controller.config, trainer=controller, console=Console(file=output, width=200))
        finally:
            controller.close()
        return [line for line in output.getvalue().splitlines() if "drafter v" in line]

    trained = lines(tmp_path / "trained")
    assert "SD in " in trained[1] and "τ " in trained[1], trained
    monkeypatch.setattr(DrafterTrainer, "_step", lambda self, stop=None: 1 / 0)
    untrained = lines(tmp_path / "untrained")
    assert all(line.endswith("drafter v0  SD waited for a trained drafter") for line in untrained), untrained


@pytest.mark.parametrize("trainer", [{}, {"run.workers": 1, "run.tail_training": "on"}], ids=["spot", "tail"])
def test_a_resume_goes_on_with_the_checkpoints_draft_vocabulary(tmp_path, trainer):
    """A run resumed under another run.draft_vocab (or from a tlt whose fresh drafter drafted over the whole
    vocabulary) goes on with its checkpoint's drafter and trainer state: loading them into a drafter of this
    config's vocabulary failed with a shape mismatch at the first rollout. Also with one worker training beside
    its own tail (its trainer is remade over the checkpoint's vocabulary)."""
    whole = make_controller(tmp_path / "a", **{"run.draft_vocab": 0}, **trainer)
    try:
        assert whole.backend.workers[0].drafter.draft_to_target is None
        whole.train_step()
        checkpoint = whole.save(tmp_path / "a")
        trained = whole.backend.hub.latest_version()
    finally:
        whole.close()
    assert trained > 0  # the checkpoint holds a spot-trained drafter
    resumed = make_controller(tmp_path / "b", **{"run.draft_vocab": 8}, **trainer)
    try:
        assert resumed.backend.workers[0].drafter.draft_vocab_size == 8
        resumed.resume(checkpoint)
        metrics = resumed.train_step()
        served = [sample.drafter_versions for sample in resumed.last_rollout.samples]
        steps, errors = metrics["spot_train_steps"], metrics["spot_train_errors"]
        for _ in range(3):  # a lone worker trains only in its own tail, which a tiny model may pass too fast to
            if steps:       # take a step in (seen once in a full suite): a few more RL steps, as a run would
                break
            more = resumed.train_step()
            steps, errors = steps + more["spot_train_steps"], errors + more["spot_train_errors"]
        sizes = [worker.drafter.draft_vocab_size for worker in resumed.backend.workers]
    finally:
        resumed.close()
    assert sizes == [16] * len(sizes)
    assert errors == 0 and steps > 0
    assert any(trained in versions for versions in served), served  # the checkpoint's drafter served


def test_a_qwen3_run_resumes_with_the_qwen3_layer_its_checkpoints_drafter_has(tmp_path, monkeypatch):
    """A Qwen3 target's new drafter has a Llama layer since 2026-12-02; a run started before checkpointed one
    with Qwen3's. Resumed, it goes on with that drafter (its trainer state fits it), serves it, and saves it in
    final/: loading its weights into the new drafter failed at the first rollout (found by a trial)."""
    import tlt.models.drafter_layer
    from conftest import tiny_model
    from tlt.models.eagle import EagleDrafter

    qwen3 = lambda: tiny_model("qwen3", vocab_size=16)  # noqa: E731
    with monkeypatch.context() as before:
        before.setitem(tlt.models.drafter_layer.NEW_DRAFTER_LAYER, "qwen3", "qwen3")
        first = make_controller(tmp_path / "a", model=qwen3())
        try:
            first.train_step()
            checkpoint = first.save(tmp_path / "a")
            trained = first.backend.hub.latest_version()
        finally:
            first.close()
    assert trained > 0
    resumed = make_controller(tmp_path / "b", model=qwen3())
    try:
        assert resumed.backend.workers[0].drafter.config.model_type == "llama"  # what a new run's gets
        resumed.resume(checkpoint)
        resumed.train_step()
        served = [sample.drafter_versions for sample in resumed.last_rollout.samples]
        layers = [worker.drafter.config.model_type for worker in resumed.backend.workers]
        final = Path(resumed.save_final(tmp_path / "final"))
    finally:
        resumed.close()
    assert layers == ["qwen3", "qwen3"]
    assert any(trained in versions for versions in served), served
    assert hasattr(EagleDrafter.load(final / "drafter", qwen3()).layer.self_attn, "q_norm")


def test_a_fresh_drafter_drafts_over_the_task_prompts_tokens_and_the_stop_token(tmp_path):
    controller = make_controller(tmp_path, **{"run.draft_vocab": 8})
    try:
        vocabularies = [worker.drafter.draft_to_target.tolist() for worker in controller.backend.workers]
    finally:
        controller.close()
    # EOS 3 always; the prompts' tokens 9, 10, 5 and 7 by frequency; topped up with the lowest ids
    assert vocabularies == [[0, 1, 2, 3, 5, 7, 9, 10]] * 2


def test_a_resume_under_another_draft_vocabulary_saves_the_final_drafter_without_a_step(tmp_path):
    """`tlt train --resume` of a run already at run.steps only writes final/: its drafter (the checkpoint's, of
    another vocabulary than the config builds) was loaded into the config's drafter and the save failed."""
    whole = make_controller(tmp_path / "a", **{"run.draft_vocab": 0})
    try:
        whole.train_step()
        checkpoint = whole.save(tmp_path / "a")
    finally:
        whole.close()
    resumed = make_controller(tmp_path / "b", **{"run.draft_vocab": 8})
    try:
        resumed.resume(checkpoint)
        final = Path(resumed.save_final(tmp_path / "final"))
    finally:
        resumed.close()
    from tlt.models.eagle import EagleDrafter

    assert EagleDrafter.load(final / "drafter", long_tail_model()).draft_to_target is None


def test_whether_a_drafter_trained_travels_with_it_not_with_the_config(tmp_path, monkeypatch):
    """A resumed run's version 0 is its checkpoint's: trained when the run was given one (even if the resumed
    config no longer names it), untrained when spot training never ran (even if the resumed config names a
    drafter, which the checkpoint's replaces)."""
    from tlt.drafter.trainer import DrafterTrainer
    from tlt.models.eagle import EagleDrafter

    given = tmp_path / "given"
    EagleDrafter(long_tail_model().config).save(given)
    lone = {"run.workers": 1, "run.speculative": "static", "run.tail_training": "off"}
    first = make_controller(tmp_path / "a", **lone, **{"run.drafter": str(given)})
    try:
        first.train_step()
        checkpoint = first.save(tmp_path / "a")
    finally:
        first.close()
    resumed = make_controller(tmp_path / "b", **{**lone, "run.tail_training": "on"})
    try:
        resumed.resume(checkpoint)
        resumed.train_step()
        served = [sample.drafter_versions for sample in resumed.last_rollout.samples]
    finally:
        resumed.close()
    assert any(0 in versions for versions in served), served  # the given drafter served from the first step

    monkeypatch.setattr(DrafterTrainer, "_step", lambda self, stop=None: 1 / 0)  # spot training never trains
    untrained = make_controller(tmp_path / "c")
    try:
        untrained.train_step()
        checkpoint = untrained.save(tmp_path / "c")
    finally:
        untrained.close()
    resumed = make_controller(tmp_path / "d", **{"run.drafter": str(given)})
    try:
        resumed.resume(checkpoint)
        metrics = resumed.train_step()
        final = Path(resumed.save_final(tmp_path / "final"))
    finally:
        resumed.close()
    assert metrics["sd/sd_step_share"] == 0 and metrics["drafter_trained"] is False
    assert not (final / "drafter").exists()  # nothing trained to serve
