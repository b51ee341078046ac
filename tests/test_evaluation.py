"""Held-out evaluation: disjoint from training, greedy (deterministic), in the metrics at the right steps."""

import json

import pytest
import torch

from test_trainer import TARGET, make_trainer
from tlt.distributed.run import train
from tlt.tasks import ArithmeticTask, DatasetTask, TaskExample
from tlt.tasks.held_out import split_held_out
from tlt.tasks.synthetic import IdTokenizer, TargetTokenTask, share_of_target


def with_held_out(trainer, size=6):
    held = TargetTokenTask(TARGET).sample(size, seed=4242)
    trainer.task.eval_examples = held
    return held


@pytest.mark.parametrize("every,steps,expected", [(1, 3, [1, 2, 3]), (2, 3, [2, 3]), (5, 3, [3])])
def test_eval_metrics_at_the_right_steps(tmp_path, every, steps, expected):
    trainer = make_trainer(tmp_path, **{"run.steps": steps, "task.eval_size": 6, "task.eval_every": every})
    with_held_out(trainer)
    train(trainer.config, trainer=trainer)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_accuracy" in r] == expected
    final = trainer.evaluate()  # the last eval ran on these very weights: greedy gives the same numbers
    assert (records[-1]["eval_accuracy"], records[-1]["eval_reward_mean"]) == (
        final["eval_accuracy"], final["eval_reward_mean"])


def test_greedy_eval_is_deterministic_and_tracks_the_policy(tmp_path):
    trainer = make_trainer(tmp_path, **{"task.eval_size": 6})
    with_held_out(trainer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    first, again = trainer.evaluate(), trainer.evaluate()
    assert first["eval_reward_mean"] == again["eval_reward_mean"]
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # evaluation never trains
    for _ in range(8):  # the task is learnable: the held-out greedy reward must move with the policy
        trainer.train_step()
    assert trainer.evaluate()["eval_reward_mean"] > first["eval_reward_mean"]


def test_held_out_dataset_examples_are_never_trained_on():
    examples = [TaskExample(f"q{i}", str(i)) for i in range(20)]
    training, held = split_held_out(DatasetTask(examples), 5)
    assert [e.prompt for e in held] == [f"q{i}" for i in range(15, 20)]
    drawn = {e.prompt for seed in range(50) for e in training.sample(10, seed)}
    assert drawn == {f"q{i}" for i in range(15)}


def test_held_out_arithmetic_problems_are_never_trained_on():
    training, held = split_held_out(ArithmeticTask(), 200)
    prompts = {e.prompt for e in held}
    assert len(prompts) > 50
    for seed in range(300):
        assert not prompts & {e.prompt for e in training.sample(16, seed)}


def test_eval_size_that_leaves_nothing_to_train_on_is_an_error():
    from tlt.errors import TltError

    with pytest.raises(TltError, match="leaves no training examples"):
        split_held_out(DatasetTask([TaskExample("q", "1")] * 3), 3)


class TextTokenizer(IdTokenizer):
    """A chat "template" that maps a prompt's last characters to ids 6..15: real tasks on the tiny model."""

    chat_template = "last characters"

    def apply_chat_template(self, messages, **kwargs):
        return [6 + ord(c) % 10 for c in messages[-1]["content"][-5:]]


@pytest.mark.parametrize("source", ["arithmetic", "jsonl"])
def test_the_trainer_never_trains_on_held_out_prompts(tmp_path, monkeypatch, source):
    """Through build_task, as `tlt train` does: the problems of every step are outside the held-out set."""
    import tlt.tasks.held_out

    # the held-out stream on step 0's seed: its problems are exactly what step 0 would draw, unless excluded
    monkeypatch.setattr(tlt.tasks.held_out, "EVAL_SEED", 0)
    from tlt.models import LoadedModel, ModelSpec
    from tlt.rl.config import load_config
    from tlt.rl.rewards import Reward
    from tlt.rl.trainer import GRPOTrainer
    from conftest import tiny_model

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"what is {i} + 0?", "answer": str(i)}) + "\n" for i in range(10)))
    model = tiny_model("llama", vocab_size=16)
    loaded = LoadedModel(model, TextTokenizer(), ModelSpec.from_config(model.config), "tiny")
    task = [f"task.name={source}"] + ([f"task.path={data}"] if source == "jsonl" else [])
    config = load_config(None, [*task, "task.eval_size=4", "run.steps=3",
                                "run.speculative=off", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
                                "rollout.max_new_tokens=4", f"run.out_dir={tmp_path / 'run'}",
                                "run.tensorboard=false"])
    trainer = GRPOTrainer(config, loaded=loaded, reward=Reward(share_of_target))
    held = {e.prompt for e in trainer.task.eval_examples}
    trained = []
    score = trainer.score
    trainer.score = lambda examples, rollout: trained.extend(examples) or score(examples, rollout)
    history = train(config, trainer=trainer)
    assert len(held) == 4 and len(trained) == 12
    assert not held & {e.prompt for e in trained}
    if source == "jsonl":  # the dataset's tail is held out
        assert held == {f"what is {i} + 0?" for i in range(6, 10)}
    assert ["eval_accuracy" in m for m in history] == [True] * 3


@pytest.mark.parametrize("workers", [1, 2])
def test_distributed_runs_evaluate_once_per_due_step(tmp_path, workers):
    """DistributedGRPO: rank 0 evaluates after the update; every replica is identical, so one answer serves."""
    from test_distributed import ShortLongTask, make_controller

    controller = make_controller(tmp_path, **{"run.workers": workers, "run.speculative": "off", "run.steps": 3,
                                              "task.eval_size": 2, "task.eval_every": 2,
                                              "rollout.max_new_tokens": 12})
    from tlt.rl.phases import evaluate as evaluate_policy

    evaluated = []
    rank0 = controller.backend.workers[0]
    rank0.replica.task.eval_examples = ShortLongTask().sample(2, seed=0)  # the task all ranks share in-process
    evaluate = rank0.evaluate

    def recording(step):
        result = evaluate(step)
        if result:
            evaluated.append(step)
        return result
    rank0.evaluate = recording
    try:
        history = train(controller.config, trainer=controller)
        again = evaluate_policy(rank0.replica)
    finally:
        controller.close()
    assert evaluated == [2, 3]
    assert [("eval_accuracy" in m) for m in history] == [False, True, True]
    assert history[-1]["eval_reward_mean"] == again["eval_reward_mean"]
    # one STOPPER prompt (a 1-token answer, no 8s) and one RUNNER prompt: the mean is half the runner's share
    assert 0 < history[-1]["eval_reward_mean"] < 0.5


def test_evaluation_leaves_the_speculation_bandit_alone(tmp_path):
    """The held-out set is decoded without SD: greedy observations would skew the bandit's rollout estimates."""
    from tlt.models.eagle import EagleDrafter

    probe = make_trainer(tmp_path / "probe")
    EagleDrafter(probe.model.config).save(tmp_path / "drafter")
    trainer = make_trainer(tmp_path / "run", **{"run.speculative": "adaptive", "run.drafter": str(tmp_path / "drafter"),
                                                "run.gate": 64, "task.eval_size": 6})
    with_held_out(trainer)
    trainer.train_step()
    state = trainer.engine.speculation.state_dict()
    summary = trainer.engine.speculation.summary()
    trainer.evaluate()
    assert trainer.engine.speculation.state_dict() == state and trainer.engine.speculation.summary() == summary
