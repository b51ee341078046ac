"""Run directories and checkpoints: one run never clobbers another, retention, optional optimizer state, and the
final policy as a Hugging Face model directory."""

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from test_trainer import make_trainer
from tlt.cli import main
from tlt.rl.checkpoint import latest_checkpoint
from tlt.rl.run import train
from tlt.rl.run_dir import RunDirError


def run(tmp_path, steps=2, resume=False, overwrite=False, **overrides):
    trainer = make_trainer(tmp_path, **{"run.steps": steps, **overrides})
    return trainer, train(trainer.config, resume=resume, overwrite=overwrite, trainer=trainer)


def metric_steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_fresh_run_refuses_a_directory_holding_another_run(tmp_path):
    run(tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match="already holds a run.*--resume.*--overwrite"):
        run(tmp_path, **{"optim.lr": 0.02})
    assert (tmp_path / "metrics.jsonl").read_text() == before  # history kept


def test_overwrite_starts_over(tmp_path):
    run(tmp_path, steps=3)
    (tmp_path / "notes.txt").write_text("mine")  # not tlt's: must survive
    run(tmp_path, steps=1, overwrite=True, **{"optim.lr": 0.02})
    assert metric_steps(tmp_path) == [1]
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-000001"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_resume_refuses_nothing_to_resume_and_a_changed_run(tmp_path):
    with pytest.raises(RunDirError, match="nothing to resume") as error:
        run(tmp_path, resume=True)
    assert "--resume continues" not in str(error.value)
    run(tmp_path)
    with pytest.raises(RunDirError, match=r"optim\.lr"):
        run(tmp_path, steps=3, resume=True, **{"optim.lr": 0.5})
    _, history = run(tmp_path, steps=3, resume=True, **{"run.checkpoint_every": 2})  # operational: allowed
    assert len(history) == 1 and metric_steps(tmp_path) == [1, 2, 3]


@pytest.mark.parametrize("keep,expected", [(2, ["step-000003", "step-000004"]), (0, [f"step-00000{i}" for i in
                                                                                    range(1, 5)])])
def test_keep_checkpoints(tmp_path, keep, expected):
    run(tmp_path, steps=4, **{"run.keep_checkpoints": keep})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == expected


def test_checkpoints_without_optimizer_state_still_resume(tmp_path, caplog):
    run(tmp_path, **{"run.save_optimizer": False})
    checkpoint = latest_checkpoint(tmp_path)
    assert not (checkpoint / "optimizer.safetensors").exists()
    _, history = run(tmp_path, steps=3, resume=True, **{"run.save_optimizer": False})
    assert len(history) == 1 and "optimizer starts fresh" in caplog.text


@pytest.mark.parametrize("tied", [False, True])
def test_final_policy_is_a_hugging_face_model_directory(tmp_path, tied):
    trainer = make_trainer(tmp_path, tied=tied, **{"run.steps": 1})
    train(trainer.config, trainer=trainer)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert list((tmp_path / "final").glob("*.safetensors")) and not list((tmp_path / "final").glob("*.bin"))
    trained = trainer.model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    assert loaded.config.tie_word_embeddings == tied


def test_cli_out_dir_under_a_file_is_one_line_before_loading(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    from test_bad_input import model_dir
    code = main(["train", f"run.out_dir={tmp_path / 'file' / 'run'}", f"model.path={model_dir(tmp_path)}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is a file, not a directory" in err[0], err


def test_config_change_of_the_seed_is_refused_but_speculation_is_not(tmp_path):
    run(tmp_path)
    with pytest.raises(RunDirError, match=r"run\.seed"):
        run(tmp_path, steps=3, resume=True, **{"run.seed": 7})
    config = make_trainer(tmp_path, **{"run.steps": 3}).config
    speculative = dataclasses.replace(config, run=dataclasses.replace(config.run, speculative="adaptive"))
    from tlt.rl.run_dir import prepare_run_dir
    assert prepare_run_dir(tmp_path, speculative.to_dict(), resume=True, overwrite=False) == latest_checkpoint(tmp_path)


def test_the_driver_is_told_when_the_rollout_is_over(tmp_path):
    """The spinner after the rollout bar: minutes of log-probs and update would otherwise pass in silence."""
    from test_distributed import make_controller

    phases = []
    trainer = make_trainer(tmp_path / "single")
    trainer.on_phase = phases.append
    trainer.train_step()
    controller = make_controller(tmp_path / "workers")
    controller.on_phase = phases.append
    try:
        controller.train_step()
    finally:
        controller.close()
    assert phases == ["step 1: log-probs and update"] * 2
