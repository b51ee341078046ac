"""The GRPO trainer end to end on a tiny model: learning, shared weights, accumulation invariance, resume."""

import dataclasses

import pytest
import torch

from conftest import tiny_model
from tlt.models import LoadedModel, ModelSpec
from tlt.rl.config import TrainConfig, load_config
from tlt.rl.rewards import Reward
from tlt.distributed.run import train
from tlt.rl.trainer import GRPOTrainer
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams
from tlt.tasks.synthetic import IdTokenizer, TargetTokenTask, share_of_target

TARGET = 5  # the toy task rewards emitting this token


def make_trainer(tmp_path, seed=0, tied=False, model=None, **overrides):
    model = model if model is not None else tiny_model("llama", vocab_size=16, seed=seed, tie_word_embeddings=tied)
    loaded = LoadedModel(model, IdTokenizer(), ModelSpec.from_config(model.config), "tiny")
    settings = ["run.speculative=off", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=8",
                "rollout.max_new_tokens=6",
                "optim.lr=0.01", "optim.micro_batch_size=8", f"run.out_dir={tmp_path}", "run.tensorboard=false",
                *[f"{k}={v}" for k, v in overrides.items()]]
    return GRPOTrainer(load_config(None, settings), loaded=loaded, task=TargetTokenTask(TARGET),
                       reward=Reward(share_of_target))


def test_reward_rises_on_a_learnable_task(tmp_path):
    trainer = make_trainer(tmp_path)
    rewards = [trainer.train_step()["reward_mean"] for _ in range(12)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.25, rewards


def test_engine_sees_the_updated_weights_without_a_copy(tmp_path):
    trainer = make_trainer(tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    prompt = [7, 8, 9]
    params = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=())
    engine_tokens = trainer.engine.generate([Request(prompt, params=params)]).samples[0].token_ids
    with torch.no_grad():
        hf = trainer.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, 3:].tolist()
    assert engine_tokens == hf


@pytest.mark.parametrize("micro", [{"optim.micro_batch_size": 3}, {"optim.micro_batch_tokens": 40}],
                         ids=["rows", "token-budget"])
def test_micro_batching_does_not_change_the_update(tmp_path, monkeypatch, micro):
    from tlt.rl import phases

    one = make_trainer(tmp_path / "a", **{"optim.micro_batch_size": 32})
    many = make_trainer(tmp_path / "b", **micro)
    grouped = []
    group = phases.micro_batches
    monkeypatch.setattr(phases, "micro_batches", lambda config, packed: grouped.append(group(config, packed))
                        or grouped[-1])
    # SGD: the update is the accumulated gradient itself (Adam's first step is ~lr * sign(grad), which would
    # turn float-rounding differences of near-zero gradients into full-size differences)
    for trainer in (one, many):
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
    one.train_step()
    assert all(len(groups) == 1 for groups in grouped)
    grouped.clear()
    many.train_step()
    assert grouped and all(len(groups) > 1 for groups in grouped)
    for a, b in zip(one.model.parameters(), many.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(one.model.parameters(), tiny_model('llama', vocab_size=16).parameters()))


@pytest.mark.parametrize("loss", ["dapo", "dr_grpo"])
def test_loss_variants_and_kl_run(tmp_path, loss):
    """The first update starts from the reference itself (KL exactly 0); the next one has moved away from it."""
    trainer = make_trainer(tmp_path, **{"grpo.loss": loss, "grpo.kl_coef": 0.05, "grpo.scale_rewards": False})
    assert trainer.train_step()["train/kl"] == 0.0
    assert trainer.train_step()["train/kl"] > 1e-7


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_resume_continues_exactly(tmp_path, tied):
    """Tied: the default SmolLM2 ties embed_tokens and lm_head; the checkpoint keeps one name of the pair."""
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = make_trainer(full_dir, tied=tied, **{"run.steps": 3})
    expected = train(full.config, trainer=full)
    partial = make_trainer(resumed_dir, tied=tied, **{"run.steps": 2})
    train(partial.config, trainer=partial)
    config = dataclasses.replace(partial.config, run=dataclasses.replace(partial.config.run, steps=3))
    # different init: resume must overwrite it
    fresh = make_trainer(resumed_dir, seed=123, tied=tied, **{"run.steps": 3})
    history = train(config, resume=True, trainer=fresh)
    assert len(history) == 1
    for key in ("reward_mean", "response_len_p50", "train/loss", "train/ratio_mean"):
        assert history[0][key] == pytest.approx(expected[2][key], rel=1e-5, abs=1e-6), key
    lines = (resumed_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # no step lost, none double-counted


def test_reward_failures_are_counted_not_fatal(tmp_path):
    def broken(completion, example):
        raise KeyError("oops")

    trainer = make_trainer(tmp_path)
    trainer.reward = Reward(broken)
    metrics = trainer.train_step()
    assert metrics["reward_failures"] == 32 and metrics["reward_mean"] == 0.0


def test_default_config_is_valid_and_round_trips_through_yaml(tmp_path):
    import yaml

    from tlt.rl.config import validate

    config = validate(TrainConfig())
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    assert load_config(path) == config


def test_actor_pass_feeds_the_drafter_buffer_with_the_engines_features(tmp_path):
    """The old-log-prob pass (training-mode transformers forward, right padded) stores, per sample, the last
    prompt token + the response with the same features the lean inference forward computes."""
    import copy

    from tlt.drafter.buffer import FeatureBuffer
    from tlt.models import KVCache, LeanForward

    trainer = make_trainer(tmp_path)
    trainer.feature_buffer = FeatureBuffer(max_tokens=100_000)
    before_update = LeanForward(copy.deepcopy(trainer.model))
    trainer.train_step()
    buffer = trainer.feature_buffer
    assert len(buffer) == 32 and buffer.steps() == [0]
    prompt = trainer.task.sample(4, seed=trainer.config.run.seed * 1_000_003)[0].meta["ids"]
    entry = buffer.entries[0]
    assert entry.tokens[0] == prompt[-1]
    sequence = prompt + entry.tokens[1:].tolist()
    rows = KVCache(before_update.spec, 1, 32).rows(0, 1)
    hidden = before_update(torch.tensor([sequence]), rows, logits_at=None).hidden[0]
    assert (entry.features - hidden[len(prompt) - 1:]).abs().max() < 1e-4


@pytest.mark.parametrize("mode,drafter", [("static", "oracle"), ("adaptive", "oracle"), ("static", "wrong")])
def test_speculative_modes_share_the_step(tmp_path, mode, drafter):
    """The step's τ comes from the engine's real SD steps: an exact drafter gets drafts accepted (τ > 1), one
    that only ever drafts a token the target never emits gets none (τ exactly 1, the bonus token alone)."""
    from conftest import markov_model, oracle_drafter
    from tlt.models.eagle import EagleDrafter

    model, transition = markov_model(16, sharpness=2.0, seed=1)
    # pad, bos and 2: the target never emits them, the wrong drafter drafts nothing else (three: arms branch K <= 3)
    never = torch.tensor([0, 1, 2])
    with torch.no_grad():
        transition[:, never] = -30.0
        model.lm_head.weight.copy_(transition.t() / 16 ** 0.5)
    chosen = oracle_drafter(model) if drafter == "oracle" else EagleDrafter(model.config, never)
    chosen.save(tmp_path / "drafter")
    trainer = make_trainer(tmp_path / mode, model=model, **{"run.speculative": mode, "run.gate": 64,
                                                            "run.drafter": str(tmp_path / "drafter")})
    metrics = trainer.train_step()
    assert metrics["sd/sd_step_share"] > 0
    if drafter == "oracle":
        assert metrics["sd/tau"] > 1.3
    else:
        assert metrics["sd/tau"] == 1.0


def test_speculative_mode_without_a_drafter_is_a_clear_error(tmp_path, caplog):
    from tlt.errors import TltError

    with pytest.raises(TltError, match="needs run.drafter"):  # nothing would ever train one
        make_trainer(tmp_path, **{"run.speculative": "adaptive", "run.workers": 1, "run.tail_training": "off"})
    # a config `tlt train` would run (its lone worker trains the drafter beside its tail), in a driver that does not
    trainer = make_trainer(tmp_path, **{"run.speculative": "adaptive", "run.workers": 1})
    assert "GRPOTrainer neither spot-trains nor tail-trains a drafter" in caplog.text
    assert not trainer.engine.drafter_trained  # held back: the run is right, just never speculative


def test_bandit_state_is_checkpointed_and_restored(tmp_path):
    from tlt.models.eagle import EagleDrafter

    probe = make_trainer(tmp_path / "probe")
    EagleDrafter(probe.model.config).save(tmp_path / "drafter")
    settings = {"run.speculative": "adaptive", "run.drafter": str(tmp_path / "drafter"), "run.gate": 64}
    trainer = make_trainer(tmp_path / "run", **settings)
    trainer.train_step()
    trainer.save(tmp_path / "run")
    resumed = make_trainer(tmp_path / "run", **settings)
    from tlt.rl.checkpoint import latest_checkpoint

    resumed.resume(latest_checkpoint(tmp_path / "run"))
    assert resumed.engine.speculation.state_dict() == trainer.engine.speculation.state_dict()


def test_command_line_values_keep_their_text_for_string_fields(tmp_path):
    from tlt.rl.config import ConfigError

    config = load_config(None, ["run.speculative=off", "run.drafter=none", "optim.lr=1e-3", "run.steps=5"])
    assert (config.run.speculative, config.run.drafter, config.optim.lr, config.run.steps) == ("off", None, 1e-3, 5)
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  speculative: off\n")  # YAML 1.1 reads an unquoted off as false
    with pytest.raises(ConfigError, match="quote it"):
        load_config(path)
    path.write_text('run:\n  speculative: "off"\n')
    assert load_config(path).run.speculative == "off"


@pytest.mark.parametrize("key,value,message", [("grpo.loss", "ppo", "grpo.loss must be one of"),
                                               ("optim.lr", -1.0, "optim.lr must be > 0")])
def test_a_config_built_in_code_is_checked_as_the_command_lines_is(key, value, message):
    """GRPOTrainer skipped validation: grpo.loss=ppo failed after the whole first rollout, a negative lr inside
    torch, a dict with AttributeError (found by a new-user pass). The model is never loaded first."""
    from tlt.rl.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(TrainConfig().override(key, value), loaded="not loaded: the check comes first")
    with pytest.raises(ConfigError, match="GRPOTrainer needs a TrainConfig .* got dict"):
        GRPOTrainer({"model": {}})


def test_length_percentiles_interpolate_between_ranks():
    """p50 is the median: rounding the rank half to even put p50 of [10, 20] at 10 and of [10, 20, 30, 40] at 30."""
    from tlt.metrics.step import _percentile

    assert _percentile([10, 20], 50) == 15 and _percentile([10, 20, 30, 40], 50) == 25
    assert _percentile(list(range(1, 17)), 50) == 8.5 and _percentile([7], 90) == 7
    assert _percentile(list(range(0, 101)), 90) == 90 and _percentile([1, 2, 3, 4], 100) == 4
