"""examples/: every config loads as `tlt train` reads it (from the repository root), names every key (the full
one), and its dataset builds; the GSM8K-style problems are graded by the reward a run uses."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from tlt.cli import main
from tlt.rl.config import TrainConfig, load_config
from tlt.rl.rewards import build_reward
from tlt.tasks import DATASET_TASKS, load_task_examples

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert {"grpo_smollm2.yaml", "hf_dataset.yaml"} <= {path.name for path in EXAMPLES}
    assert (ROOT / "examples" / "gsm8k_style.jsonl").exists()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_every_example_config_loads_and_its_dataset_builds(path, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # paths in the examples are relative to the repository root
    config = load_config(path.relative_to(ROOT))
    assert config.run.out_dir.startswith("runs/")  # never the default directory another run may hold
    if config.task.name in DATASET_TASKS:
        if config.task.name == "hf":
            datasets = pytest.importorskip("datasets")
            monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
        examples = load_task_examples(config.task)
        assert len(examples) >= config.rollout.prompts_per_step + config.task.eval_size


def test_the_full_example_names_every_section_and_key():
    """A key added to the config is added (commented) to examples/grpo_smollm2.yaml too."""
    written = yaml.safe_load((ROOT / "examples" / "grpo_smollm2.yaml").read_text())
    for section in dataclasses.fields(TrainConfig):
        keys = [f.name for f in dataclasses.fields(section.default_factory())]
        missing = [key for key in keys if key not in written.get(section.name, {})]
        assert not missing, f"examples/grpo_smollm2.yaml lacks {section.name}.{', '.join(missing)}: add it, commented"


def test_the_gsm8k_style_problems_have_numeric_answers_the_reward_grades(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_config(None, ["task.name=jsonl", "task.path=examples/gsm8k_style.jsonl"])
    examples = load_task_examples(config.task)
    assert len(examples) == 12
    reward = build_reward(config.task)
    right = [f"Step by step.\nThe answer is \\boxed{{{e.answer}}}" for e in examples]
    wrong = [f"\\boxed{{{int(float(e.answer)) + 1}}}" for e in examples]
    assert all(reward.score(right, examples).correct)
    assert not any(reward.score(wrong, examples).correct)


def test_print_config_of_an_example_takes_the_file_either_way(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["train", "examples/hf_dataset.yaml", "run.steps=2", "--print-config"]) == 0
    positional = capsys.readouterr().out
    assert main(["train", "--config", "examples/hf_dataset.yaml", "run.steps=2", "--print-config"]) == 0
    assert capsys.readouterr().out == positional
    printed = yaml.safe_load(positional)
    assert printed["task"]["name"] == "hf" and printed["run"]["steps"] == 2
