"""Held-out evaluation: disjoint from training, greedy (deterministic), in the metrics at the right steps."""

import json

import pytest

from test_trainer import TARGET, make_trainer
from tlt.rl.run import train
from tlt.tasks import ArithmeticTask, DatasetTask, TaskExample
from tlt.tasks.held_out import split_held_out
from tlt.tasks.synthetic import TargetTokenTask


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
    assert all(0 <= r["eval_accuracy"] <= 1 for r in records if "eval_accuracy" in r)


def test_greedy_eval_is_deterministic_and_tracks_the_policy(tmp_path):
    trainer = make_trainer(tmp_path, **{"task.eval_size": 6})
    with_held_out(trainer)
    first, again = trainer.evaluate(), trainer.evaluate()
    assert first["eval_reward_mean"] == again["eval_reward_mean"]
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
