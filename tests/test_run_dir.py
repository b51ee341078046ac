"""Run directories and checkpoints: one run never clobbers another, retention, optional optimizer state, and the
final policy as a Hugging Face model directory."""

import dataclasses
import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from test_trainer import make_trainer
from tlt.cli import main
from tlt.rl.checkpoint import latest_checkpoint
from tlt.rl.config import load_config
from tlt.distributed.run import train
from tlt.rl.run_dir import RunDirError, prepare_run_dir


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
    assert not (tmp_path / ".replaced").exists()  # the old run went once the new one had a checkpoint
    assert (tmp_path / "notes.txt").read_text() == "mine"


def snapshot(run_dir):
    """Every file under the run directory (the lock aside) with its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".tlt-lock"}


def test_overwrite_that_fails_before_its_first_checkpoint_puts_the_old_run_back(tmp_path, monkeypatch):
    """--overwrite deleted the old run before the new one had trained a step: a crash in its first step lost
    both (found by review)."""
    run(tmp_path, steps=2)
    before = snapshot(tmp_path)
    trainer = make_trainer(tmp_path, **{"run.steps": 3, "optim.lr": 0.02, "run.checkpoint_every": 0})
    logged = trainer.train_step

    def crash_in_second_step():
        if trainer.step == 1:
            raise RuntimeError("CUDA error: an illegal memory access")
        return logged()

    monkeypatch.setattr(trainer, "train_step", crash_in_second_step)
    with pytest.raises(RuntimeError, match="illegal memory"):
        train(trainer.config, overwrite=True, trainer=trainer)  # only the end would have saved
    assert snapshot(tmp_path) == before and not (tmp_path / ".replaced").exists()


def test_resuming_a_directory_that_does_not_exist_leaves_none_behind(tmp_path):
    """It made the directory (the run lock) before refusing: an empty directory was left (found by QA)."""
    trainer = make_trainer(tmp_path / "nowhere")
    with pytest.raises(RunDirError, match="nothing to resume in .*nowhere: no such directory"):
        train(trainer.config, resume=True, trainer=trainer)
    assert not (tmp_path / "nowhere").exists()


def test_sigterm_is_handled_as_ctrl_c(tmp_path, monkeypatch, capsys):
    """SIGTERM (a scheduler's stop, `kill`) ended `tlt train` without a word, an interrupted --overwrite leaving
    the old run aside until the next start (found by review). Now it is Ctrl-C: said, and the old run put back."""
    import signal

    from tlt import cli

    before = overwrite_signalled_mid_step(tmp_path, monkeypatch, signal.SIGTERM)
    handler = signal.getsignal(signal.SIGTERM)
    assert cli.main(["report", str(tmp_path)]) == 143  # (the command is stood in for)
    output = capsys.readouterr()
    assert "tlt: terminated (SIGTERM)" in output.err
    assert "interrupted after 0 completed step(s)" in output.out and "is back in" in output.out
    assert snapshot(tmp_path) == before and not (tmp_path / ".replaced").exists()
    assert signal.getsignal(signal.SIGTERM) == handler  # given back


def overwrite_signalled_mid_step(tmp_path, monkeypatch, signum) -> dict:
    """A 2-step run in tmp_path, then `tlt train --overwrite` (the CLI's command stood in for) whose first step
    sends this process `signum`; returns the old run's snapshot."""
    import os
    import time

    from tlt import cli

    run(tmp_path, steps=2)
    before = snapshot(tmp_path)
    trainer = make_trainer(tmp_path, **{"run.steps": 3, "optim.lr": 0.02})

    def signalled_mid_step():
        os.kill(os.getpid(), signum)
        time.sleep(30)  # the handler raises before this ends
        raise AssertionError(f"signal {signum} was not handled")

    monkeypatch.setattr(trainer, "train_step", signalled_mid_step)
    monkeypatch.setattr(cli, "_run_command", lambda args: train(trainer.config, overwrite=True, trainer=trainer))
    return before


@pytest.mark.parametrize("handled", [True, False], ids=["handled", "control-python-default"])
def test_a_second_ctrl_c_does_not_cut_the_clean_up_short(tmp_path, monkeypatch, capsys, handled):
    """Ctrl-C twice (found by QA): the second one interrupted the clean-up (here while an interrupted --overwrite
    puts the old run back), and the process died on an abort. The second is now ignored (said, with how to
    abort) until the command has cleaned up. Control: Python's own handler lets the second one through, and the
    old run stays aside."""
    import contextlib
    import signal

    from tlt import cli
    from tlt.distributed import run as run_module

    before = overwrite_signalled_mid_step(tmp_path, monkeypatch, signal.SIGINT)
    restore = run_module.restore_replaced

    def interrupted_again(run_dir):
        signal.raise_signal(signal.SIGINT)
        return restore(run_dir)

    @contextlib.contextmanager
    def python_default(received):
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    monkeypatch.setattr(run_module, "restore_replaced", interrupted_again)
    if not handled:
        monkeypatch.setattr(cli, "_signals_as_one_interrupt", python_default)
    # Python's own SIGINT handler, whatever an earlier test left (Ray's start-up in another test leaves SIGINT
    # ignored, and the CLI keeps a SIGINT it finds ignored so)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = cli.main(["report", str(tmp_path)])  # (the command is stood in for)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
    finally:
        signal.signal(signal.SIGINT, handler)
    assert code == 130
    output = capsys.readouterr()
    assert "tlt: interrupted" in output.err
    if handled:
        assert "interrupt once more to abort at once" in output.err and "is back in" in output.out
        assert snapshot(tmp_path) == before and not (tmp_path / ".replaced").exists()
    else:
        assert "is back in" not in output.out and (tmp_path / ".replaced").exists()


def test_a_signal_the_process_inherited_as_ignored_stays_ignored():
    """`tlt train ... &` from a script inherits SIGINT ignored: the CLI's handler must not take it over."""
    import signal

    from tlt import cli

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with cli._signals_as_one_interrupt([]):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # (not inherited ignored: taken)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_resume_of_files_no_tlt_run_wrote_does_not_advise_overwrite(tmp_path):
    """--resume said 'start over with --overwrite', which then refused the same directory (found by QA)."""
    (tmp_path / "final").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    config = load_config(None, [f"run.out_dir={tmp_path}"]).to_dict()
    with pytest.raises(RunDirError, match="it holds no tlt run .*set another run.out_dir, or move its files"):
        prepare_run_dir(tmp_path, config, resume=True, overwrite=False)
    with pytest.raises(RunDirError, match="but no tlt run"):
        prepare_run_dir(tmp_path, config, resume=False, overwrite=True)


def test_held_interrupts_raise_at_the_end_of_the_block_and_yield_to_its_own_error():
    import signal

    from tlt.interrupts import held_interrupts

    # Python's own SIGINT handler, whatever an earlier test left (a full-suite run once had another in place,
    # and the re-raised SIGINT went there: no KeyboardInterrupt)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        held_interrupts_raise_and_yield(held_interrupts)
    finally:
        signal.signal(signal.SIGINT, previous)


def held_interrupts_raise_and_yield(held_interrupts):
    import signal

    done = []
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            signal.raise_signal(signal.SIGINT)
            done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(OSError, match="disk full"):  # the block's own failure is the one reported
        with held_interrupts():
            signal.raise_signal(signal.SIGINT)
            raise OSError("disk full")


def test_an_ignored_interrupt_stays_ignored_inside_a_held_block(capsys):
    """A run started with SIGINT ignored (`tlt train ... &` from a script) said "stopping" at a SIGINT inside a
    held block and went on, and three aborted it (found by a trial): ignored there too."""
    import signal

    from tlt.interrupts import held_interrupts

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with held_interrupts(notice="stopping once the step is saved"):
            for _ in range(3):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "stopping" not in capsys.readouterr().err


@pytest.mark.parametrize("signals", [3, 2])
def test_a_third_interrupt_inside_a_held_block_aborts_at_once(signals):
    """A worker that hangs in a checkpoint save held every Ctrl-C until its call's limit (hours; found by QA): the
    third ends the process (130), as outside the block. Two are still held to the block's end (the control)."""
    import subprocess
    import sys

    script = ("import signal, sys\n"
              "from tlt.interrupts import held_interrupts\n"
              # Python's own handler: a process started in the background (make test &) inherits SIGINT ignored
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "try:\n"
              "    with held_interrupts():\n"
              f"        for _ in range({signals}):\n"
              "            signal.raise_signal(signal.SIGINT)\n"
              "        print('block finished', flush=True)\n"
              "except KeyboardInterrupt:\n"
              "    sys.exit(7)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    if signals == 3:
        assert done.returncode == 130 and "tlt: aborted" in done.stderr and "block finished" not in done.stdout
    else:
        assert done.returncode == 7 and "block finished" in done.stdout and "once more to abort" in done.stderr


@pytest.mark.parametrize("held", [True, False], ids=["held", "control-not-held"])
def test_a_stop_just_after_a_step_still_checkpoints_that_step(tmp_path, monkeypatch, capsys, held):
    """A SIGTERM that came while a finished step was being logged (its metrics line printed, its timeline drawn)
    ended the run before the step's checkpoint was written: the step was in metrics.jsonl and lost (found by
    QA). The step's bookkeeping now completes first. Control: without the hold, no checkpoint."""
    import contextlib
    import os
    import signal

    from tlt import cli
    from tlt.distributed import run as run_module

    class SignallingLine(str):  # the step's metrics line: printed before its checkpoint is written
        def format(self, **values):
            os.kill(os.getpid(), signal.SIGTERM)
            return "step line"

    monkeypatch.setattr(run_module, "METRICS_LINE", SignallingLine(run_module.METRICS_LINE))
    if not held:
        monkeypatch.setattr(run_module, "held_interrupts", contextlib.nullcontext)
    trainer = make_trainer(tmp_path, **{"run.steps": 3, "run.checkpoint_every": 1})
    monkeypatch.setattr(cli, "_run_command", lambda args: train(trainer.config, trainer=trainer))
    handler = signal.getsignal(signal.SIGTERM)
    assert cli.main(["report", str(tmp_path)]) == 143  # (the command is stood in for)
    assert signal.getsignal(signal.SIGTERM) == handler
    assert (tmp_path / "step-000001").is_dir() == held
    assert metric_steps(tmp_path) == [1]
    output = capsys.readouterr()
    assert "interrupted after 1 completed step(s)" in output.out
    assert ("tlt: stopping once step 1 is logged (and checkpointed" in output.err) == held


def test_overwrite_killed_before_its_first_checkpoint_is_undone_by_the_next_start(tmp_path):
    """A SIGKILL leaves the old run in RUN/.replaced: the next tlt train puts it back, then decides as usual."""
    run(tmp_path, steps=2)
    before = snapshot(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["optim"]["lr"] = 0.02
    assert prepare_run_dir(tmp_path, config, resume=False, overwrite=True) is None
    assert latest_checkpoint(tmp_path) is None and (tmp_path / ".replaced").is_dir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # the new run's first step, then the kill
    with pytest.raises(RunDirError, match="already holds a run"):
        prepare_run_dir(tmp_path, config, resume=False, overwrite=False)
    assert snapshot(tmp_path) == before
    assert prepare_run_dir(tmp_path, json.loads((tmp_path / "config.json").read_text()), resume=True,
                           overwrite=False) == tmp_path / "step-000002"


def test_overwrite_killed_after_its_first_checkpoint_drops_the_old_run_at_the_next_start(tmp_path):
    run(tmp_path, steps=2)
    trainer = make_trainer(tmp_path, **{"run.steps": 1, "optim.lr": 0.02})
    prepare_run_dir(tmp_path, trainer.config.to_dict(), resume=False, overwrite=True)
    trainer.train_step()
    trainer.save(tmp_path)  # then killed before discarding the old run
    assert prepare_run_dir(tmp_path, trainer.config.to_dict(), resume=True, overwrite=False) == tmp_path / "step-000001"
    assert not (tmp_path / ".replaced").exists()


def test_a_users_step_named_directories_are_not_checkpoints(tmp_path):
    """Only step- and digits is a checkpoint: a user's `step-notes/` broke a fresh run with a traceback and
    --overwrite deleted it; a backup `step-000002-good/` was resumed from, then pruned (found by review)."""
    (tmp_path / "step-notes").mkdir()
    (tmp_path / "step-notes" / "mine.txt").write_text("mine")
    run(tmp_path, steps=2, **{"run.keep_checkpoints": 1})
    import shutil
    shutil.copytree(tmp_path / "step-000002", tmp_path / "step-000002-good")
    assert latest_checkpoint(tmp_path).name == "step-000002"
    run(tmp_path, steps=3, resume=True, **{"run.keep_checkpoints": 1})
    assert latest_checkpoint(tmp_path).name == "step-000003" and (tmp_path / "step-000002-good").is_dir()
    run(tmp_path, steps=1, overwrite=True, **{"optim.lr": 0.02})
    assert (tmp_path / "step-notes" / "mine.txt").read_text() == "mine" and (tmp_path / "step-000002-good").is_dir()


def test_overwrite_refuses_to_delete_the_model_it_is_about_to_load(tmp_path):
    """`model.path=RUN_DIR/final --overwrite` deleted the trained policy, then failed to load it (found by review)."""
    run(tmp_path, steps=1)
    final = tmp_path / "final"
    assert final.is_dir()
    with pytest.raises(RunDirError, match=r"model\.path=.*lies inside .*--overwrite would delete"):
        run(tmp_path, steps=1, overwrite=True, **{"model.path": str(final)})
    assert final.is_dir() and latest_checkpoint(tmp_path) is not None


def test_resume_refuses_nothing_to_resume_and_a_changed_run(tmp_path):
    with pytest.raises(RunDirError, match="nothing to resume") as error:
        run(tmp_path, resume=True)
    assert "--resume continues" not in str(error.value)
    run(tmp_path)
    with pytest.raises(RunDirError, match=r"optim\.lr"):
        run(tmp_path, steps=3, resume=True, **{"optim.lr": 0.5})
    _, history = run(tmp_path, steps=3, resume=True, **{"run.checkpoint_every": 2})  # operational: allowed
    assert len(history) == 1 and metric_steps(tmp_path) == [1, 2, 3]


@pytest.mark.parametrize("inside", ["step-000001", "final", "notes/more"])
def test_a_run_inside_another_runs_directory_is_refused(tmp_path, inside):
    """`run.out_dir=RUN/step-000001` wrote a run into a checkpoint that pruning then deleted (found by review)."""
    from tlt.rl.config import TrainConfig

    config = TrainConfig().to_dict()
    fake_run(tmp_path, config)
    (tmp_path / "final").mkdir()
    with pytest.raises(RunDirError, match=f"lies inside the run in {tmp_path}"):
        prepare_run_dir(tmp_path / inside, config, resume=False, overwrite=False)
    assert not (tmp_path / "notes").exists()  # refused before anything is made
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # a model directory, not a run: allowed
    assert prepare_run_dir(tmp_path / inside, config, resume=False, overwrite=False) is None


@pytest.mark.parametrize("below", ["a", "group/a"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_run_in_a_directory_holding_other_runs_is_refused(tmp_path, below, overwrite):
    """`run.out_dir=runs` for `runs/x` was accepted: the runs below then lay inside it, and each refused its own
    --resume (found by QA). Refused before anything is written, naming the run; directories without a run, a
    model's directory and the run's own checkpoints are not runs below it."""
    from tlt.rl.config import TrainConfig

    config = TrainConfig().to_dict()
    runs = tmp_path / "runs"
    (runs / below).mkdir(parents=True)
    fake_run(runs / below, config)
    (runs / "notes").mkdir()
    (runs / "notes" / "x.txt").write_text("mine")
    (runs / "model").mkdir()
    (runs / "model" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(RunDirError, match=f"holds another run \\({runs / below}\\).*run.out_dir={runs / 'new-run'}"):
        prepare_run_dir(runs, config, resume=False, overwrite=overwrite)
    assert not (runs / "config.json").exists()
    assert prepare_run_dir(runs / below, config, resume=True, overwrite=False) is not None  # still resumable
    shutil.rmtree(runs / below.split("/")[0])
    assert prepare_run_dir(runs, config, resume=False, overwrite=overwrite) is None  # control: no run below
    fake_run(runs, config)  # its own checkpoint (step-000001/) is not a run below it
    assert prepare_run_dir(runs, config, resume=False, overwrite=True) is None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fake_run(elsewhere, config)
    (runs / "linked").symlink_to(elsewhere)  # linked in, not inside: not refused
    assert prepare_run_dir(runs, config, resume=False, overwrite=True) is None


def test_a_drafters_directory_is_refused_as_a_run_directory(tmp_path):
    """A run wrote its config, checkpoints and final policy beside a drafter's files (found by QA)."""
    from tlt.rl.config import TrainConfig

    (tmp_path / "drafter_config.json").write_text("{}")
    (tmp_path / "drafter.safetensors").write_bytes(b"")
    with pytest.raises(RunDirError, match="holds a drafter .*drafter_config.json.*run.drafter="):
        prepare_run_dir(tmp_path, TrainConfig().to_dict(), resume=False, overwrite=False)
    assert not (tmp_path / "config.json").exists()


def test_resume_accepts_a_new_device_batch_size_and_path_spelling_and_names_what_changed(tmp_path, monkeypatch):
    """--resume refused model.device, rollout.max_batch_size, optim.micro_batch_size (memory and speed, not
    meaning) and `./data.jsonl` for `data.jsonl`; its error named the keys without their values (found by review)."""
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["run.out_dir=run", "task.name=jsonl", "task.path=data.jsonl"]).to_dict()
    (tmp_path / "run").mkdir()
    fake_run(tmp_path / "run", config)
    moved = load_config(None, ["run.out_dir=run", "task.name=jsonl", f"task.path={tmp_path}/./data.jsonl",
                               "model.device=cpu", "rollout.max_batch_size=8", "optim.micro_batch_size=1",
                               "model.path=smollm2"]).to_dict()
    assert prepare_run_dir(tmp_path / "run", moved, resume=True, overwrite=False).name == "step-000001"
    other = load_config(None, ["run.out_dir=run", "task.name=jsonl", "task.path=other.jsonl",
                               "rollout.temperature=0.7"]).to_dict()
    with pytest.raises(RunDirError, match=rf'task\.path: "{tmp_path}/data\.jsonl" in the run, '
                                          rf'"{tmp_path}/other\.jsonl" now; rollout\.temperature: 1\.0 in the '
                                          r"run, 0\.7 now\)"):
        prepare_run_dir(tmp_path / "run", other, resume=True, overwrite=False)


def test_resume_hides_what_the_crashed_run_logged_past_its_checkpoint(tmp_path):
    """TensorBoard kept a crashed run's steps past the checkpoint beside the resumed run's (two points per step),
    and timeline pictures of steps the resumed run never reached again stayed (found by review)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, steps=3, **{"run.checkpoint_every": 2, "run.keep_checkpoints": 0, "run.tensorboard": True})
    shutil.rmtree(tmp_path / "step-000003")  # as if killed before step 3's checkpoint
    (tmp_path / "timeline").mkdir()
    for step in (2, 3):
        (tmp_path / "timeline" / f"step_{step:04d}.json").write_text("{}")
    _, history = run(tmp_path, steps=3, resume=True, **{"run.tensorboard": True})
    assert len(history) == 1 and metric_steps(tmp_path) == [1, 2, 3]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("reward_mean")] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "timeline").iterdir()) == ["step_0002.json"]


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
    assert code == 2 and len(err) == 1 and f"{tmp_path / 'file'} is a file, not a directory" in err[0], err


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


def test_step_lines_never_wrap_and_the_run_ends_saying_where_it_is(tmp_path, capsys, monkeypatch):
    """Off a terminal rich wraps at 80 columns: a step line (~95 characters) would break in logs and pipes."""
    monkeypatch.setenv("COLUMNS", "80")
    run(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all(line.endswith("tok/s") for line in steps), lines
    assert lines[-1] == (f"run saved in {tmp_path} (final policy: {tmp_path / 'final'}); "
                         f"see it with: tlt report {tmp_path}")


def test_the_command_a_run_ends_with_survives_a_path_with_spaces_and_brackets(tmp_path, capsys, monkeypatch):
    """`tlt report sp ace/r un` pasted into a shell is two arguments (found by a CLI trial), and rich read
    "[b]" as markup and dropped it: the suggested command is quoted, the path printed as it is."""
    import shlex

    monkeypatch.setenv("COLUMNS", "80")
    run_dir = tmp_path / "sp ace" / "r [b] un"
    run_dir.mkdir(parents=True)
    run(run_dir, steps=1)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f"run saved in {run_dir} ("), last
    assert shlex.split(last.split("see it with: ")[1]) == ["tlt", "report", str(run_dir)]


def fake_run(run_dir, config_dict, checkpoint=True):
    """A run directory as tlt leaves it, without training: config.json, metrics, maybe one checkpoint."""
    (run_dir / "config.json").write_text(json.dumps(config_dict))
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    if checkpoint:
        (run_dir / "step-000001").mkdir()
        (run_dir / "step-000001" / "state.json").write_text("{}")


@pytest.mark.parametrize("overwrite", [False, True])
def test_folders_with_tlts_names_that_no_run_wrote_are_refused_not_deleted(tmp_path, overwrite):
    """A directory holding a user's final/ and timeline/ and some metrics.jsonl, but no tlt run: the refusal said
    "already holds a run ... --overwrite (deletes that run)", and --overwrite deleted them (found by review)."""
    from tlt.rl.config import TrainConfig

    for folder in ("final", "timeline"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "keep.txt").write_text("mine")
    (tmp_path / "metrics.jsonl").write_text("not tlt's\n")
    with pytest.raises(RunDirError, match=r"holds timeline/, final/, metrics\.jsonl but no tlt run \(no config\.json "
                                          r"of one beside them\)"):
        prepare_run_dir(tmp_path, TrainConfig().to_dict(), resume=False, overwrite=overwrite)
    assert (tmp_path / "final" / "keep.txt").read_text() == (tmp_path / "timeline" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "config.json").exists() and not (tmp_path / ".replaced").exists()


def test_a_run_that_died_before_its_first_step_is_still_tlts(tmp_path):
    """A fresh run writes config.json before anything loads: what a failed load leaves (a TensorBoard directory)
    lies beside it, so a retry is not taken for someone else's files."""
    from tlt.rl.config import TrainConfig

    assert prepare_run_dir(tmp_path, TrainConfig().to_dict(), resume=False, overwrite=False) is None
    expected = json.loads(json.dumps(TrainConfig().to_dict()))
    expected["run"]["out_dir"] = os.path.abspath(expected["run"]["out_dir"])  # paths are kept absolute
    assert json.loads((tmp_path / "config.json").read_text()) == expected
    (tmp_path / "tensorboard").mkdir()  # then the policy failed to load
    assert prepare_run_dir(tmp_path, TrainConfig().to_dict(), resume=False, overwrite=False) is None


def test_a_run_without_checkpoints_is_described_by_what_it_holds(tmp_path):
    from tlt.rl.config import TrainConfig
    from tlt.rl.run_dir import describe

    (tmp_path / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    (tmp_path / "final").mkdir()
    assert describe(tmp_path) == "final, no checkpoint"  # it said "metrics", which were not there
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert describe(tmp_path) == "metrics.jsonl and final, no checkpoint"
    with pytest.raises(RunDirError, match=r"already holds a run \(metrics\.jsonl and final, no checkpoint\)"):
        prepare_run_dir(tmp_path, TrainConfig().to_dict(), resume=False, overwrite=False)


def test_resume_of_a_run_that_never_saved_points_at_overwrite(tmp_path):
    from tlt.rl.config import TrainConfig
    from tlt.rl.run_dir import prepare_run_dir

    config = TrainConfig().to_dict()
    fake_run(tmp_path, config, checkpoint=False)
    with pytest.raises(RunDirError, match="no checkpoint.*--overwrite") as error:
        prepare_run_dir(tmp_path, config, resume=True, overwrite=False)
    assert "run without --resume" not in str(error.value)  # that would only be refused next


def test_resume_accepts_a_config_saved_by_an_older_tlt(tmp_path):
    """Fields added to tlt since the run started count as their defaults; fields tlt dropped are ignored;
    evaluating more or less often does not change the run."""
    from tlt.rl.config import TrainConfig
    from tlt.rl.run_dir import prepare_run_dir

    config = TrainConfig().to_dict()
    saved = json.loads(json.dumps(config))
    del saved["task"]["eval_size"]
    saved["grpo"]["a_dropped_field"] = 1
    fake_run(tmp_path, saved)
    config["task"]["eval_every"] = 5
    assert prepare_run_dir(tmp_path, config, resume=True, overwrite=False) == tmp_path / "step-000001"
    config["task"]["eval_size"] = 8
    with pytest.raises(RunDirError, match=r"\(task\.eval_size: 0 in the run, 8 now\)"):
        prepare_run_dir(tmp_path, config, resume=True, overwrite=False)


def test_a_run_from_before_rollout_is_resumes_as_it_ran(tmp_path):
    """A run started before grpo.rollout_is trained without importance weights: --resume under the new default
    ("auto", on for a CUDA run) would change its gradient silently, and rollout_is=off was refused as a change
    (found by review)."""
    from tlt.rl.config import TrainConfig
    from tlt.rl.run_dir import prepare_run_dir

    config = TrainConfig().to_dict()
    saved = json.loads(json.dumps(config))
    del saved["grpo"]["rollout_is"]
    fake_run(tmp_path, saved)
    with pytest.raises(RunDirError, match=r"grpo\.rollout_is: \"off\" in the run, \"auto\" now"):
        prepare_run_dir(tmp_path, config, resume=True, overwrite=False)
    config["grpo"]["rollout_is"] = "off"
    assert prepare_run_dir(tmp_path, config, resume=True, overwrite=False) == tmp_path / "step-000001"


def test_workers_write_checkpoints_and_the_final_policy_through_the_trainers_save(tmp_path):
    """The distributed run saves through the one run-checkpoint writer (rl/run_checkpoint.py), with its drafter;
    it resumes."""
    from test_distributed import make_controller

    controller = make_controller(tmp_path, **{"run.steps": 1, "run.save_optimizer": False})
    try:
        train(controller.config, trainer=controller)
    finally:
        controller.close()
    checkpoint = latest_checkpoint(tmp_path)
    state = json.loads((checkpoint / "state.json").read_text())
    assert {"config", "drafter", "workers"} <= set(state) and state["optimizer"] is None
    assert (checkpoint / "drafter.safetensors").exists() and not (checkpoint / "optimizer.safetensors").exists()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final").config.vocab_size == 16
    resumed = make_controller(tmp_path, **{"run.steps": 2, "run.save_optimizer": False})
    try:
        assert len(train(resumed.config, resume=True, trainer=resumed)) == 1
    finally:
        resumed.close()
    assert metric_steps(tmp_path) == [1, 2]


def test_a_run_with_a_drafter_leaves_it_beside_the_final_policy_ready_to_export_and_reuse(tmp_path, capsys):
    """The deployable drafter is the run's byproduct: RUN/final/drafter holds its last spot-trained version (the
    checkpoint's), with its trainer state, and `tlt drafter export` turns it into an EAGLE model for vLLM."""
    from safetensors.torch import load_file
    from test_distributed import make_controller
    from tlt.drafter.export import import_eagle
    from tlt.drafter.trainer import DrafterTrainer
    from tlt.models.eagle import EagleDrafter
    from tlt.rl.preflight import _check_drafter

    run_dir = tmp_path / "run"
    controller = make_controller(run_dir, **{"run.steps": 1})
    try:
        train(controller.config, trainer=controller)
        version = controller.backend.hub.latest_version()
    finally:
        controller.close()
    drafter_dir = run_dir / "final" / "drafter"
    assert version > 0  # spot training published versions: the final one is a trained drafter, not the initial
    checkpoint = load_file(str(latest_checkpoint(run_dir) / "drafter.safetensors"))
    final = load_file(str(drafter_dir / "drafter.safetensors"))
    assert final.keys() == checkpoint.keys() and all(torch.equal(final[k], checkpoint[k]) for k in final)
    assert DrafterTrainer.has_saved_state(drafter_dir) and DrafterTrainer.saved_state(drafter_dir)["steps"] > 0
    policy = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    drafter = EagleDrafter.load(drafter_dir, policy)
    _check_drafter(drafter_dir, run_dir / "final")  # run.drafter=RUN/final/drafter passes the next run's checks
    assert main(["drafter", "export", str(drafter_dir), "--model", str(run_dir / "final"), "--out",
                 str(tmp_path / "eagle")]) == 0
    exported = import_eagle(tmp_path / "eagle", policy)
    own = drafter.state_dict()  # the final policy is saved in float32: served, and so exported, in bfloat16
    assert all(torch.equal(value, own[name].to(torch.bfloat16).to(value.dtype))
               for name, value in exported.state_dict().items() if name in own)
    out = capsys.readouterr().out
    assert "names float32" in out and "--dtype bfloat16" in out
    assert f"its drafter: {drafter_dir}" in out
    assert "spot-train" in out and "drafter steps" in out and "tail-train" not in out  # two workers: spot training


def test_a_resume_with_sd_off_keeps_the_runs_trained_drafter_for_a_later_resume_with_sd_on(tmp_path, capsys):
    """`--resume run.speculative=off` saved checkpoints and a final/ without the drafter the run had trained, and
    pruning then deleted the last checkpoint holding it (found by a trial). It is carried through the SD-off
    steps unchanged, said at the resume, and a later --resume with SD on goes on from it."""
    from safetensors.torch import load_file
    from test_distributed import make_controller

    run_dir = tmp_path / "run"

    def segment(steps, resume, **overrides):
        controller = make_controller(run_dir, **{"run.steps": steps, "run.keep_checkpoints": 1, **overrides})
        try:
            train(controller.config, resume=resume, trainer=controller)
            return controller.backend.hub.latest_version() if controller.speculative else None
        finally:
            controller.close()

    trained = segment(1, False)
    assert trained > 0
    weights = load_file(str(latest_checkpoint(run_dir) / "drafter.safetensors"))
    segment(2, True, **{"run.speculative": "off"})
    assert f"note: SD is off: the run's drafter (v{trained} in step-000001)" in capsys.readouterr().out
    assert latest_checkpoint(run_dir).name == "step-000002"  # step-000001 pruned
    for kept in (latest_checkpoint(run_dir) / "drafter.safetensors", run_dir / "final" / "drafter" /
                 "drafter.safetensors"):
        assert all(torch.equal(v, weights[k]) for k, v in load_file(str(kept)).items())
    assert segment(3, True) > trained  # SD on again: its trainer went on from the carried version


def test_a_resume_refuses_another_run_drafter_and_keeps_the_one_the_run_started_from(tmp_path):
    """run.drafter given on --resume was loaded, then replaced by the checkpoint's drafter without a word, and
    config.json recorded it as the run's (found by a trial): another one is refused, naming it; left out, the
    resume goes on and config.json keeps the drafter the run started from."""
    from tlt.rl.run_dir import config_text_to_keep

    started = load_config(None, [f"run.drafter={tmp_path}/d1"]).to_dict()
    fake_run(tmp_path, started)
    other = load_config(None, [f"run.drafter={tmp_path}/d3"]).to_dict()
    state = {"step": 1, "python_rng": []}
    (tmp_path / "step-000001" / "state.json").write_text(json.dumps(state))
    # a checkpoint without a drafter (SD was off): the given one is where SD starts (found by review)
    assert prepare_run_dir(tmp_path, other, resume=True, overwrite=False).name == "step-000001"
    state["drafter"] = {"version": 3, "trainer": None}
    (tmp_path / "step-000001" / "state.json").write_text(json.dumps(state))
    for same in (started, load_config(None, []).to_dict()):
        assert prepare_run_dir(tmp_path, same, resume=True, overwrite=False).name == "step-000001"
    with pytest.raises(RunDirError, match=rf'run\.drafter: "{tmp_path}/d1" in the run, "{tmp_path}/d3" now; '
                                          r"run\.drafter is the drafter a run starts from: --resume goes on with the "
                                          r"one its checkpoint holds"):
        prepare_run_dir(tmp_path, other, resume=True, overwrite=False)
    kept = json.loads(config_text_to_keep(tmp_path, load_config(None, ["run.steps=5"]).to_dict()))
    assert kept["run"]["drafter"] == f"{tmp_path}/d1" and kept["run"]["steps"] == 5


def test_workers_without_a_drafter_print_their_idle_share_not_drafter_vnone(tmp_path, capsys):
    from test_distributed import make_controller

    controller = make_controller(tmp_path, **{"run.steps": 1, "run.speculative": "off", "rollout.max_new_tokens": 8})
    try:
        train(controller.config, trainer=controller)
    finally:
        controller.close()
    out = capsys.readouterr().out
    assert "(no drafter: run.speculative=off)" in out and "vNone" not in out and "spot-train" not in out


def test_a_run_without_a_drafter_writes_none(tmp_path):
    from test_distributed import make_controller

    run(tmp_path, steps=1)
    assert (tmp_path / "final").is_dir() and not (tmp_path / "final" / "drafter").exists()
    (tmp_path / "untrained").mkdir()
    controller = make_controller(tmp_path / "untrained")  # speculative, but its drafter never trained (v0)
    try:
        controller.save_final(tmp_path / "untrained" / "final")
    finally:
        controller.close()
    assert not (tmp_path / "untrained" / "final" / "drafter").exists()


@pytest.mark.parametrize("gate_off", [False, True])
def test_a_speculative_run_whose_drafter_never_trained_says_why_final_has_none(tmp_path, capsys, monkeypatch,
                                                                                gate_off):
    """gate_off: run.gate=auto found no arm that pays (sd/gate 0), which its step lines said; the end of the run
    blamed a short run or no idle worker instead (found by QA)."""
    from test_distributed import make_controller
    from tlt.distributed.controller import DistributedGRPO
    from tlt.distributed.worker import RolloutWorker

    untrained = {"trained_steps": 0, "published": [], "error": None, "loss": None, "top1": None}
    monkeypatch.setattr(RolloutWorker, "spot_train", lambda self, step: untrained)  # no worker sat idle
    if gate_off:
        step = DistributedGRPO.train_step
        monkeypatch.setattr(DistributedGRPO, "train_step", lambda self: {**step(self), "sd/gate": 0})
    controller = make_controller(tmp_path, **{"run.steps": 1})
    try:
        train(controller.config, trainer=controller)
    finally:
        controller.close()
    assert not (tmp_path / "final" / "drafter").exists()
    out = capsys.readouterr().out
    assert "the run's drafter never trained" in out
    assert ("SD was off: no arm pays on this device" in out) == gate_off
    assert ("no spot-training step ran" in out) != gate_off


def test_a_run_placement_turned_off_speculation_for_is_not_said_to_have_an_untrained_drafter(tmp_path, capsys):
    """workers=auto coming to one worker with run.tail_training=off: placement turns speculation off and says so,
    and the end of the run then blamed 'no spot-training step ran' for the missing drafter (found by QA)."""
    import dataclasses

    from test_distributed import make_controller

    controller = make_controller(tmp_path, **{"run.steps": 1, "run.workers": 1, "run.speculative": "off"})
    asked = dataclasses.replace(controller.config, run=dataclasses.replace(
        controller.config.run, workers="auto", speculative="static", tail_training="off"))  # as given
    try:
        train(asked, trainer=controller)
    finally:
        controller.close()
    assert "never trained" not in capsys.readouterr().out


def test_a_given_drafter_is_kept_beside_the_final_policy_even_untrained_by_the_run(tmp_path):
    """run.drafter=DIR (a warmed drafter) that spot training never improved is still the run's drafter."""
    from safetensors.torch import load_file
    from test_distributed import long_tail_model, make_controller
    from tlt.models.eagle import EagleDrafter

    torch.manual_seed(3)
    EagleDrafter(long_tail_model().config).save(tmp_path / "warmed")
    (tmp_path / "run").mkdir()
    controller = make_controller(tmp_path / "run", **{"run.drafter": str(tmp_path / "warmed")})
    try:
        controller.save_final(tmp_path / "run" / "final")
    finally:
        controller.close()
    saved = load_file(str(tmp_path / "run" / "final" / "drafter" / "drafter.safetensors"))
    given = load_file(str(tmp_path / "warmed" / "drafter.safetensors"))
    assert saved.keys() == given.keys() and all(torch.equal(saved[k], given[k]) for k in saved)


def test_cli_refuses_an_occupied_run_dir_in_one_line_and_overwrite_is_a_flag(tmp_path, capsys):
    from test_bad_input import model_dir
    from tlt.rl.config import TrainConfig

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fake_run(run_dir, TrainConfig().to_dict())
    code = main(["train", f"run.out_dir={run_dir}", f"model.path={model_dir(tmp_path)}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("tlt: error: "), err
    assert all(hint in err[0] for hint in ("--resume", "--overwrite", "run.out_dir")), err
    assert (run_dir / "metrics.jsonl").exists()


def test_cli_passes_overwrite_and_resume_to_train(tmp_path, monkeypatch):
    import tlt.distributed.run

    calls = []
    monkeypatch.setattr(tlt.distributed.run, "train", lambda config, **flags: calls.append(flags))
    assert main(["train", f"run.out_dir={tmp_path}", "--overwrite"]) == 0
    assert main(["train", f"run.out_dir={tmp_path}", "--resume"]) == 0
    assert calls == [{"resume": False, "overwrite": True}, {"resume": True, "overwrite": False}]


def test_a_run_that_died_in_its_first_step_does_not_block_a_retry(tmp_path):
    """config.json is written before step 1; a crash then leaves nothing worth protecting."""
    from tlt.rl.config import TrainConfig
    from tlt.rl.run_dir import prepare_run_dir

    (tmp_path / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    (tmp_path / "metrics.jsonl").write_text("")
    assert prepare_run_dir(tmp_path, TrainConfig().to_dict(), resume=False, overwrite=False) is None


@pytest.mark.parametrize("damage", ["state.json", "policy.safetensors", "rng.safetensors"])
def test_resume_from_a_damaged_checkpoint_names_the_file_and_the_way_out(tmp_path, damage):
    """A checkpoint file cut short or missing (a disk filled up, a bad copy) is one CheckpointError naming the file
    and pointing at the checkpoint before it, never a JSON traceback or `--resume continues from` that same one."""
    from tlt.rl.checkpoint import CheckpointError

    run(tmp_path, steps=2)
    file = tmp_path / "step-000002" / damage
    if damage == "rng.safetensors":
        file.unlink()
    else:
        file.write_bytes(file.read_bytes()[:len(file.read_bytes()) // 2])
    with pytest.raises(CheckpointError, match=f"{file}.*delete {tmp_path / 'step-000002'} to resume from step-000001"):
        run(tmp_path, steps=3, resume=True)


def test_a_checkpoints_damaged_drafter_is_a_checkpoint_error(tmp_path):
    """The distributed driver restores the drafter from the checkpoint: a damaged file there names itself too
    (a worker's SafetensorError would read as a crash and send the user to --resume the same checkpoint)."""
    from tlt.rl.checkpoint import CheckpointError
    from tlt.rl.run_checkpoint import DRAFTER_FILE, read_drafter

    checkpoint = tmp_path / "step-000001"
    checkpoint.mkdir()
    (checkpoint / "state.json").write_text(json.dumps({"step": 1, "python_rng": [], "drafter": {"version": 3,
                                                                                              "trainer": None}}))
    (checkpoint / DRAFTER_FILE).write_bytes(b"\x08")
    with pytest.raises(CheckpointError, match=f"{checkpoint / DRAFTER_FILE}.*--overwrite"):
        read_drafter(checkpoint)


def test_a_second_run_on_a_directory_in_use_is_refused(tmp_path):
    """Two `tlt train` on one run.out_dir (a second started while the first loads its model, or a --resume while
    the first still runs) both trained, writing both runs' steps into one metrics.jsonl and checkpoints of
    either config under one history. The directory is held for the run's lifetime; the lock ends with it."""
    import os

    from tlt.rl.run_dir import hold_run_dir

    with hold_run_dir(tmp_path):  # another run, in the middle of its first step
        with pytest.raises(RunDirError, match=f"in use by another tlt train \\(process {os.getpid()}\\)"):
            run(tmp_path)
        assert not (tmp_path / "metrics.jsonl").exists()
    run(tmp_path)  # released
    run(tmp_path, steps=3, resume=True)  # and released again after a run
    assert metric_steps(tmp_path) == [1, 2, 3]


def test_a_refused_run_directory_is_left_as_it_was(tmp_path):
    """Refused runs left `.tlt-lock` in a model's directory, a drafter's, another run's checkpoint, a directory
    of runs or of tlt-named folders and an empty directory given to --resume, and made directories inside runs
    (found by a trial and a review): now nothing."""
    run(tmp_path / "runs" / "run", steps=1)
    model, drafter, foreign, empty = (tmp_path / name for name in ("model", "drafter", "foreign", "empty"))
    for directory in (model, drafter, foreign / "timeline", empty):
        directory.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (drafter / "drafter_config.json").write_text("{}")
    inside = tmp_path / "runs" / "run"
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for out_dir, resume, refusal in ((inside / "step-000001", False, "lies inside the run"),
                                     (inside / "sub", False, "lies inside the run"), (inside, False, "already holds"),
                                     (tmp_path / "runs", False, "holds another run"),
                                     (model, False, "not a tlt run's"), (drafter, False, "holds a drafter"),
                                     (foreign, False, "but no tlt run"), (empty, True, "nothing to resume"),
                                     (tmp_path / "new", True, "no such directory")):
        with pytest.raises(RunDirError, match=refusal):
            run(out_dir, steps=1, resume=resume)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_the_lock_file_is_never_unlinked_so_two_runs_never_lock_two_files(tmp_path):
    """A run that unlinked its lock on the way out let a process that had opened the old file lock it while a
    third locked a new one: both ran (found by review). The file stays; the third is refused."""
    import fcntl

    from tlt.rl.run_dir import LOCK_FILE, hold_run_dir

    with hold_run_dir(tmp_path):
        opened_before = open(tmp_path / LOCK_FILE, "a+")  # a second run between its open and its flock
    try:
        fcntl.flock(opened_before, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first one has ended: it gets the lock
        with pytest.raises(RunDirError, match="in use by another tlt train"):
            with hold_run_dir(tmp_path):
                pass
    finally:
        opened_before.close()


def test_a_reward_function_that_raises_is_said_on_the_console(tmp_path, capsys, caplog):
    """Every sample's reward raised and scored 0: the step line read `reward 0.000` and the cause was nowhere
    but a reward_failures count in metrics.jsonl. The first exception is logged, the count is on the console."""
    from tlt.rl.rewards import Reward

    def broken(completion, example):
        raise KeyError("answer_field")

    trainer = make_trainer(tmp_path, **{"run.steps": 1})
    trainer.reward = Reward(broken)
    train(trainer.config, trainer=trainer)
    assert "warning: the reward function failed on 32 of 32 samples (scored 0)" in capsys.readouterr().out
    assert caplog.text.count("the reward function broken raised KeyError: 'answer_field'") == 1


def test_a_reward_function_failing_on_every_sample_stops_the_run_after_three_steps(tmp_path, capsys, caplog):
    """A reward returning a string scored 0 on every sample of every step, said 'raised ValueError: could not
    convert string to float', and the run trained on nothing to the end and exited 0 (found by review)."""
    from tlt.rl.rewards import Reward, RewardError

    def returns_text(completion, example):
        return "high"

    trainer = make_trainer(tmp_path, **{"run.steps": 5, "run.checkpoint_every": 1})
    trainer.reward = Reward(returns_text)
    with pytest.raises(RewardError, match=r"failed on every sample of 3 steps in a row .* fix it and continue "
                                          r"with --resume"):
        train(trainer.config, trainer=trainer)
    assert metric_steps(tmp_path) == [1, 2, 3] and latest_checkpoint(tmp_path).name == "step-000003"
    assert "the reward function returns_text returned 'high', a string, not a number" in caplog.text


def test_a_reward_failing_on_some_samples_does_not_stop_the_run(tmp_path):
    from tlt.rl.rewards import Reward

    calls = []

    def flaky(completion, example):
        calls.append(1)
        if len(calls) % 2:
            raise ValueError("unparseable")
        return 1.0

    trainer = make_trainer(tmp_path, **{"run.steps": 4})
    trainer.reward = Reward(flaky)
    assert len(train(trainer.config, trainer=trainer)) == 4


def test_ctrl_c_says_where_to_resume_and_leaves_no_traceback(tmp_path, capsys, monkeypatch):
    """Ctrl-C printed a KeyboardInterrupt traceback through the worker futures, and nothing about what was kept."""
    import tlt.distributed.run

    trainer = make_trainer(tmp_path, **{"run.steps": 3})
    step = trainer.train_step

    def interrupted():
        if trainer.step == 1:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(trainer, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(trainer.config, trainer=trainer)
    out = capsys.readouterr().out
    assert "interrupted after 1 completed step(s): `tlt train ... --resume` continues from step-000001" in out
    assert "earlier segment" not in out  # no final/ yet
    # a final/ an earlier segment finished with is not this step's (an interrupted resume left it unsaid: a trial)
    (tmp_path / "final").mkdir()
    with pytest.raises(KeyboardInterrupt):
        train(trainer.config, resume=True, trainer=trainer)
    assert (f"note: {tmp_path / 'final'} holds the policy (and drafter) an earlier segment of the run ended with, "
            f"not step 1's") in capsys.readouterr().out

    def ctrl_c(config, **flags):
        raise KeyboardInterrupt

    monkeypatch.setattr(tlt.distributed.run, "train", ctrl_c)
    assert main(["train", f"run.out_dir={tmp_path}"]) == 130
    assert capsys.readouterr().err == "tlt: interrupted\n"


def test_ctrl_c_while_a_checkpoint_is_written_names_it_and_prunes(tmp_path, capsys, monkeypatch):
    """Ctrl-C reached the main thread while a worker thread still wrote step 3's checkpoint: the message named
    step 2's, and pruning never ran (3 checkpoints with keep_checkpoints=2; found by review). Here the save
    completes and the interrupt comes right after it, before the loop prunes."""
    trainer = make_trainer(tmp_path, **{"run.steps": 5, "run.keep_checkpoints": 2})
    save = trainer.save

    def interrupted_save(run_dir):
        save(run_dir)
        if trainer.step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        train(trainer.config, trainer=trainer)
    assert "continues from step-000003" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]


def test_resume_without_config_json_checks_against_the_checkpoints_config(tmp_path):
    """With RUN_DIR/config.json gone (deleted, or lost with a copy), --resume with another lr and loss continued
    the checkpoint silently under them; the checkpoint keeps its own config (model.device as a worker resolved
    it, which is not a change)."""
    run(tmp_path)
    (tmp_path / "config.json").unlink()
    _check_against_the_checkpoint(tmp_path)


def test_resume_with_config_json_cut_short_checks_against_the_checkpoints_config(tmp_path):
    """config.json is written in place when a run starts: one killed then leaves it cut short, and --resume
    refused with 'is not a tlt config' and no way on; the checkpoint's own config is as good a record."""
    run(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(path.read_text()[:100])
    _check_against_the_checkpoint(tmp_path)


def _check_against_the_checkpoint(tmp_path):
    state_path = latest_checkpoint(tmp_path) / "state.json"
    state = json.loads(state_path.read_text())
    state["config"]["model"]["device"] = "cpu"
    state_path.write_text(json.dumps(state))
    with pytest.raises(RunDirError, match=r"\(grpo\.loss: \"grpo\" in the run, \"dapo\" now; optim\.lr: 0\.01 in "
                                          r"the run, 0\.5 now\)"):
        run(tmp_path, steps=3, resume=True, **{"optim.lr": 0.5, "grpo.loss": "dapo"})
    _, history = run(tmp_path, steps=3, resume=True)
    assert len(history) == 1


@pytest.mark.parametrize("flags", [{}, {"overwrite": True}, {"resume": True}])
def test_a_model_directory_as_run_dir_is_refused(tmp_path, flags):
    """run.out_dir = a Hugging Face model directory (model.path, say): the run wrote its config.json over the
    model's, and --overwrite would have deleted it; the model no longer loaded."""
    from test_bad_input import model_dir

    model = model_dir(tmp_path)
    config = (model / "config.json").read_text()
    trainer = make_trainer(model, **{"run.steps": 1})
    with pytest.raises(RunDirError, match="holds a config.json that is not a tlt run's"):
        train(trainer.config, trainer=trainer, **flags)
    assert (model / "config.json").read_text() == config


def test_staging_copies_a_killed_run_left_are_dropped_on_resume(tmp_path):
    """A run killed while saving leaves .ckpt-*/.final-* staging copies (a policy and optimizer each); nothing
    removed them but --overwrite, so every kill-and-resume leaked a checkpoint's size of disk."""
    run(tmp_path)
    for name in (".ckpt-abc123", ".final-def456"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "policy.safetensors").write_bytes(b"partial")
    run(tmp_path, steps=3, resume=True)
    assert not list(tmp_path.glob(".ckpt-*")) and not list(tmp_path.glob(".final-*"))


def test_resume_of_a_finished_run_says_there_is_nothing_to_train(tmp_path, capsys):
    """--resume with run.steps at or below the checkpoint's step trained nothing without a word."""
    run(tmp_path, steps=2)
    capsys.readouterr()
    _, history = run(tmp_path, steps=2, resume=True)
    assert history == [] and metric_steps(tmp_path) == [1, 2]
    assert "nothing to train (raise run.steps to go on)" in capsys.readouterr().out
    _, history = run(tmp_path, steps=1, resume=True)  # config.json kept run.steps=2 (it was rewritten to 1)
    assert history == [] and json.loads((tmp_path / "config.json").read_text())["run"]["steps"] == 2


def test_a_cosine_that_ends_before_the_last_step_is_noted(tmp_path, capsys):
    """Extending a cosine run as the resume refusal advises (optim.decay_steps = the old run's) trained the extra
    steps at lr 0 without a word (found by a new-user pass)."""
    run(tmp_path / "zero", steps=3, **{"optim.schedule": "cosine", "optim.decay_steps": 2})
    assert "reaches lr 0 at step 2 (optim.decay_steps) and optim.min_lr_ratio=0" in capsys.readouterr().out
    run(tmp_path / "floor", steps=3, **{"optim.schedule": "cosine", "optim.decay_steps": 2,
                                        "optim.min_lr_ratio": 0.1})
    assert "reaches lr 0" not in capsys.readouterr().out


def test_a_resume_placed_on_another_number_of_workers_says_so(tmp_path):
    """A run started with run.workers=auto = 2 (the CPU default until 2026-11-25) and resumed where auto is 1 goes
    on with 1 worker, sharding and drawing its samples otherwise: said at the start, with the way to keep 2."""
    from tlt.distributed.run import _workers_changed

    checkpoint = tmp_path / "step-000002"
    checkpoint.mkdir()
    (checkpoint / "state.json").write_text(json.dumps({"step": 2, "python_rng": [], "workers": 2}))
    assert _workers_changed(checkpoint, 1) == ("step-000002 was written by a run of 2 worker(s); it goes on with 1 "
                                               "(set run.workers=2 to keep its layout)")
    assert _workers_changed(checkpoint, 2) is None
    (checkpoint / "state.json").write_text(json.dumps({"step": 2, "python_rng": []}))  # a GRPOTrainer's: no count
    assert _workers_changed(checkpoint, 1) is None


def test_resume_from_another_directory_does_not_take_another_model_for_the_runs(tmp_path, monkeypatch):
    """config.json kept `model.path=m` as given, and each --resume resolved it against its own directory: from
    another directory another model of the same shape continued the run without a word (found by review)."""
    for name in ("a", "b"):
        (tmp_path / name / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a")
    config = load_config(None, [f"run.out_dir={tmp_path}/run", "model.path=m"]).to_dict()
    assert prepare_run_dir(tmp_path / "run", config, resume=False, overwrite=False) is None
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["path"] == str(tmp_path / "a" / "m")
    (tmp_path / "run" / "step-000001").mkdir()
    (tmp_path / "run" / "step-000001" / "state.json").write_text("{}")
    assert prepare_run_dir(tmp_path / "run", config, resume=True, overwrite=False).name == "step-000001"
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(RunDirError, match=rf'model\.path: "{tmp_path}/a/m" in the run, "{tmp_path}/b/m" now'):
        prepare_run_dir(tmp_path / "run", config, resume=True, overwrite=False)
