"""A run directory: what `tlt train` writes there, and the rules that keep one run from clobbering another.

A fresh run refuses a directory that already holds a run (its history would be lost, and a later `--resume`
would continue the other run's checkpoint under the new config) unless told `--resume` or `--overwrite` (which
keeps the old run aside until the new one has a checkpoint, and puts it back if the new run ends or is killed
before that). `--resume` refuses a config that changes what the run means (model, task, sampling, loss, optimizer
and lr schedule, seed; paths compare as the files they name); operational settings (steps, workers, backend,
checkpointing, loggers, speculation: lossless; the device and batch sizes) may change, except that run.steps is
also the length of a cosine schedule whose optim.decay_steps is 0.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from pathlib import Path

from tlt.errors import TltError
from tlt.files import refuse_an_unwritable_place, write_whole
from tlt.models.eagle import CONFIG_FILE as DRAFTER_CONFIG_FILE, WEIGHTS_FILE as DRAFTER_WEIGHTS_FILE
from tlt.models.loading import is_default_source
from tlt.rl.checkpoint import (RETIRED_PREFIX, checkpoint_dirs, checkpoint_step, latest_checkpoint, read_state,
                               recover_retired)
from tlt.rl.config import PATH_KEYS, TrainConfig

# Everything tlt writes into a run directory; --overwrite replaces exactly these, nothing else.
RUN_FILES = ("metrics.jsonl", "config.json", "wandb_id", "dataset_fingerprint.json")
# the dataset task's records as the run first read them (count and digest): --resume compares
DATASET_FILE = "dataset_fingerprint.json"
RUN_DIRS = ("timeline", "tensorboard", "wandb", "report", "final")
# --overwrite moves the old run here and deletes it only once the new run has a checkpoint: a new run that
# fails (or is killed) before that has lost nothing, the old run is put back.
REPLACED_DIR = ".replaced"
RUNS_BELOW_DEPTH = 2  # how deep a fresh run's directory is searched for other runs (runs/x, runs/group/x)
LOCK_FILE = ".tlt-lock"  # held by the run writing here (hold_run_dir); not part of the run, never deleted (a run
# that unlinked it while held let the next two runs lock two files: found by review)
MEANING_SECTIONS = ("model", "task", "rollout", "grpo", "optim")
MEANING_RUN_KEYS = ("seed",)
# In a meaning section, but only how the run is measured, or how fast (or in how much memory) it computes the same
# thing (rollout.compile, rollout.kernels: fused kernels may round differently in bf16; every sample is still the
# policy's own).
# The device, and how many rows decode or backpropagate at once, change memory and speed, not what is sampled or
# the gradient (up to float summation order).
OPERATIONAL_KEYS = ("task.eval_every", "rollout.cuda_graphs", "rollout.compile", "rollout.kernels",
                    "optim.grad_checkpointing",
                    "model.device", "rollout.max_batch_size", "optim.micro_batch_size", "optim.micro_batch_tokens")


class RunDirError(TltError):
    """A run directory that cannot be used as asked."""


def prepare_run_dir(run_dir: Path, config_dict: dict, *, resume: bool, overwrite: bool,
                    dataset: dict | None = None) -> Path | None:
    """Check (and with overwrite, clear) the run directory; returns the checkpoint to resume from, if any.
    `dataset`: the dataset task's fingerprint (`tasks.dataset_fingerprint`), kept with a fresh run and compared
    on --resume."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: choose one")
    _refuse_nested(run_dir)
    _make(run_dir)
    _recover_replaced(run_dir)
    recover_retired(run_dir)  # before anything reads final/ or the checkpoints
    _refuse_foreign_config(run_dir)
    if resume:
        checkpoint = _checkpoint_to_resume(run_dir)
        _check_same_run(run_dir, config_dict, checkpoint)
        _check_same_dataset(run_dir, dataset)
        _drop_staging(run_dir)
        return checkpoint
    _refuse_for_a_fresh_run(run_dir, overwrite)
    if holds_run(run_dir):
        _refuse_inputs_inside(run_dir, config_dict)
        set_aside(run_dir)
    _drop_staging(run_dir)
    # First, before anything loads: whatever this run leaves (a TensorBoard directory from a load that failed)
    # then lies beside a tlt config.json, which is how the next run knows it as tlt's (_refuse_foreign_entries)
    text = json.dumps(_with_absolute_paths(config_dict), indent=1)
    write_whole(run_dir / "config.json", lambda path: path.write_text(text))
    if dataset is not None:
        _keep_dataset(run_dir, dataset)
    return None


def _checkpoint_to_resume(run_dir: Path) -> Path:
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise RunDirError(f"nothing to resume in {run_dir}: it holds no checkpoint ({_start_instead(run_dir)})")
    return checkpoint


def _refuse_for_a_fresh_run(run_dir: Path, overwrite: bool) -> None:
    """What a new run may not start over (its files would mix with them, --overwrite delete them)."""
    _refuse_foreign_entries(run_dir)
    _refuse_a_drafter_directory(run_dir)
    _refuse_runs_below(run_dir)
    if holds_run(run_dir) and not overwrite:
        # --resume only where there is a checkpoint: without one it would fail with "nothing to resume"
        hint = "continue it with --resume, " if latest_checkpoint(run_dir) else ""
        raise RunDirError(f"{run_dir} already holds a run ({describe(run_dir)}): {hint}start over with "
                          f"--overwrite (deletes that run), or set another run.out_dir")


def _keep_dataset(run_dir: Path, dataset: dict) -> None:
    write_whole(run_dir / DATASET_FILE, lambda path: path.write_text(json.dumps(dataset)))


def _check_same_dataset(run_dir: Path, dataset: dict | None) -> None:
    """task.path compares as a path: records appended (or edited) since the run started moved the held-out
    split (its last records) into training and changed the prompts of every step to come (found by review)."""
    if dataset is None:
        return  # a generated task, or a trainer given in code (no preflight)
    try:
        saved = json.loads((run_dir / DATASET_FILE).read_text())
    except (OSError, ValueError):  # a run from before the file: from now on, this is the run's dataset
        _keep_dataset(run_dir, dataset)
        return
    if saved != dataset:
        raise RunDirError(f"--resume: the dataset changed since the run started ({saved.get('records')} records "
                          f"then, {dataset.get('records')} now, or their text): the held-out split and every "
                          f"step's prompts would move; restore the file, or start a new run (--overwrite or "
                          f"another run.out_dir)")

def _refuse_foreign_entries(run_dir: Path) -> None:
    """Folders and files with tlt's names (final/, timeline/, metrics.jsonl...) that no tlt run wrote: no tlt
    config.json and no checkpoint beside them. A run would write into them, and --overwrite delete them."""
    if (run_dir / "config.json").exists() or latest_checkpoint(run_dir) is not None:
        return  # a tlt run's (_refuse_foreign_config has refused any other config.json)
    found = [path.name + ("/" if path.is_dir() else "") for path in run_entries(run_dir)]
    if found:
        raise RunDirError(f"run.out_dir={run_dir} holds {', '.join(found)} but no tlt run (no config.json of one "
                          f"beside them): tlt would write into them, and --overwrite delete them; set another "
                          f"run.out_dir, or move them")


def _drop_staging(run_dir: Path) -> None:
    """Staging copies of a checkpoint or final policy that a killed run left (each as large as the policy and
    its optimizer state); the caller holds the directory (hold_run_dir), so no save is under way."""
    for path in sorted(run_dir.glob(".ckpt-*")) + sorted(run_dir.glob(".final-*")):
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def hold_run_dir(run_dir: Path):
    """Hold RUN_DIR/.tlt-lock for a run's lifetime: a second `tlt train` on the same directory (started by
    mistake, or a --resume while the first still runs) is refused instead of writing both runs' steps and
    checkpoints into one history. An advisory lock of this process (the OS drops it when the process dies, so
    a killed run never leaves the directory locked); where the OS has no flock, nothing is held."""
    _make(run_dir)
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    try:
        handle = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the run's lifetime
    except OSError as error:
        raise RunDirError(f"cannot write in run.out_dir={run_dir}: {error.strerror}") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip()
            raise RunDirError(f"{run_dir} is in use by another tlt train{f' (process {owner})' if owner else ''}: "
                              f"wait for it to end, or set another run.out_dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock


def _refuse_nested(run_dir: Path) -> None:
    """A run inside another run's directory (`run.out_dir=runs/a/step-000004`, or `runs/a/final`) is pruned,
    replaced or overwritten with that run's own files."""
    for parent in Path(run_dir).resolve().parents:
        if is_tlt_run(parent):
            raise RunDirError(f"run.out_dir={run_dir} lies inside the run in {parent}, whose checkpoints, "
                              f"--overwrite and final policy would take it with them: set another run.out_dir")


def is_tlt_run(path: Path) -> bool:
    """A directory holding a tlt run: a tlt config.json beside what a new run would destroy. False for one this
    user cannot read (a volume's lost+found, another user's folder): no run of theirs could be harmed there."""
    try:
        return holds_run(path) and has_tlt_config(path)
    except OSError:
        return False


def has_tlt_config(path: Path) -> bool:
    """Whether the directory's config.json is a tlt run's (not a model's, not cut short)."""
    try:
        return _is_tlt_config(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def _refuse_runs_below(run_dir: Path) -> None:
    """A fresh run in a directory that holds other runs (`run.out_dir=runs` for `runs/x`; found by QA): each of
    them would then lie inside this run, which `_refuse_nested` makes them refuse (their --resume included),
    and this run's files would mix with their directories."""
    below = _run_below(run_dir, RUNS_BELOW_DEPTH)
    if below is not None:
        raise RunDirError(f"run.out_dir={run_dir} holds another run ({below}): a run here would hold it inside its "
                          f"own directory, and that run could not be resumed; give this run a directory of its "
                          f"own, e.g. run.out_dir={run_dir / 'new-run'}")


def _run_below(directory: Path, depth: int) -> Path | None:
    """The first tlt run in a subdirectory of `directory`, `depth` levels down at most; a run's own entries
    (checkpoints, final/, ...) and hidden directories are not looked into."""
    try:
        own = {path.name for path in run_entries(directory)}
        # not a link: a run elsewhere linked in here does not lie inside this one (_refuse_nested resolves paths)
        children = sorted(p for p in directory.iterdir() if not p.name.startswith(".") and p.name not in own
                          and not p.is_symlink() and p.is_dir())
    except OSError:  # unreadable: nothing tlt could have written there either
        return None
    for child in children:
        if is_tlt_run(child):
            return child
        if depth > 1 and (found := _run_below(child, depth - 1)) is not None:
            return found
    return None


def _refuse_a_drafter_directory(run_dir: Path) -> None:
    """A drafter's directory (`tlt drafter warmup --out`) as run.out_dir: a run would write its files beside the
    drafter's (found by QA)."""
    found = [name for name in (DRAFTER_CONFIG_FILE, DRAFTER_WEIGHTS_FILE) if (run_dir / name).exists()]
    if found:
        raise RunDirError(f"run.out_dir={run_dir} holds a drafter ({', '.join(found)}): a run would write its "
                          f"files beside it; set another run.out_dir (to train from it: run.drafter={run_dir})")


def _refuse_foreign_config(run_dir: Path) -> None:
    """A config.json that is not a tlt run's (a Hugging Face model directory's, e.g. run.out_dir = model.path):
    a run would write its own over it, and --overwrite would delete it; the model could not be loaded again."""
    path = run_dir / "config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # none, or a tlt config cut short: the rules below apply
    if not _is_tlt_config(saved):
        raise RunDirError(f"run.out_dir={run_dir} holds a config.json that is not a tlt run's (a model directory?): "
                          f"a run would replace it; set another run.out_dir")


def _is_tlt_config(saved) -> bool:
    """A tlt run's config.json is a mapping of sections (a model's config.json has scalars at its top level)."""
    return isinstance(saved, dict) and all(isinstance(v, dict) for v in saved.values())


def holds_run(run_dir: Path) -> bool:
    """Something a new run would destroy: a checkpoint, a logged step or a final policy. A run that died in its
    first step (config.json, no metrics line) holds nothing, and a retry may start over it."""
    metrics = run_dir / "metrics.jsonl"
    logged = metrics.exists() and metrics.stat().st_size > 0
    return logged or (run_dir / "final").exists() or checkpoint_dirs(run_dir) != []


def check_before_holding(run_dir: Path, resume: bool, overwrite: bool = False) -> None:
    """The refusals that read the directory only, before `hold_run_dir` makes it or writes its lock file there
    (refused runs left `.tlt-lock` in a model's directory, a drafter's and other runs' checkpoints, and made
    directories inside runs: found by a trial). `prepare_run_dir`, under the lock, checks again; a directory a
    killed run left mid-recovery (a run set aside by --overwrite, a checkpoint mid-swap) is checked only there."""
    run_dir = Path(run_dir)
    if resume and not run_dir.is_dir():
        raise RunDirError(f"nothing to resume in {run_dir}: no such directory (run without --resume to start a "
                          f"new run there)")
    _refuse_nested(run_dir)
    if not run_dir.is_dir():
        return
    _refuse_foreign_config(run_dir)
    if (run_dir / REPLACED_DIR).exists() or any(run_dir.glob(f"{RETIRED_PREFIX}*")):
        return
    if resume:
        _checkpoint_to_resume(run_dir)
    else:
        _refuse_for_a_fresh_run(run_dir, overwrite)


def _start_instead(run_dir: Path) -> str:
    """What to do instead of --resume: a run that died before its first checkpoint can only start over."""
    if holds_run(run_dir) and not (run_dir / "config.json").exists():  # not a tlt run's: --overwrite refuses it
        return "it holds no tlt run (no config.json of one): set another run.out_dir, or move its files"
    if holds_run(run_dir):
        return "its run ended before its first checkpoint: start over with --overwrite, or set another run.out_dir"
    return "run without --resume to start a new run there"


def describe(run_dir: Path) -> str:
    checkpoints = checkpoint_dirs(run_dir)
    if not checkpoints:
        found = [name for name in ("metrics.jsonl", "final") if (run_dir / name).exists()]
        return f"{' and '.join(found) or 'its files'}, no checkpoint"
    return f"{len(checkpoints)} checkpoint(s), the last at step {checkpoint_step(checkpoints[-1])}"


def _refuse_inputs_inside(run_dir: Path, config_dict: dict) -> None:
    """--overwrite deletes the run: never a model, drafter or dataset the new run is about to read from inside it
    (`model.path=RUN_DIR/final --overwrite` deleted the trained policy, then failed to load it)."""
    root = run_dir.resolve()
    for section, key in PATH_KEYS:
        if (section, key) == ("run", "out_dir"):
            continue
        value = (config_dict.get(section) or {}).get(key)
        if value and Path(value).expanduser().resolve().is_relative_to(root):
            raise RunDirError(f"{section}.{key}={value} lies inside {run_dir}, which --overwrite would delete: copy it "
                              f"out first, or set another run.out_dir")


def run_entries(run_dir: Path) -> list[Path]:
    """What tlt wrote in the run directory (checkpoints, metrics, timeline, TensorBoard, wandb, report, final);
    staging copies are _drop_staging's."""
    named = [run_dir / name for name in RUN_DIRS + RUN_FILES]
    return checkpoint_dirs(run_dir) + [path for path in named if path.exists()]


def set_aside(run_dir: Path) -> None:
    """--overwrite: move the old run into RUN_DIR/.replaced (renames, no copy) until discard_replaced."""
    aside = run_dir / REPLACED_DIR
    aside.mkdir()
    for path in run_entries(run_dir):
        os.replace(path, aside / path.name)


def discard_replaced(run_dir: Path) -> None:
    """The new run has a checkpoint of its own: the run it replaced goes for good."""
    shutil.rmtree(Path(run_dir) / REPLACED_DIR, ignore_errors=True)


def restore_replaced(run_dir: Path) -> bool:
    """The new run ended before its first checkpoint (nothing of it can be resumed): delete what it wrote and
    put the run it replaced back. Returns whether there was one."""
    aside = Path(run_dir) / REPLACED_DIR
    if not aside.is_dir():
        return False
    for path in run_entries(Path(run_dir)):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    for path in aside.iterdir():
        os.replace(path, Path(run_dir) / path.name)
    aside.rmdir()
    return True


def _recover_replaced(run_dir: Path) -> None:
    """A run started with --overwrite was killed: it kept the old run aside until its first checkpoint."""
    if latest_checkpoint(run_dir) is None:
        restore_replaced(run_dir)
    else:
        discard_replaced(run_dir)


def _make(run_dir: Path) -> None:
    refuse_an_unwritable_place(run_dir, "cannot use run.out_dir", RunDirError)  # names the file, maybe a parent
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunDirError(f"cannot create run.out_dir={run_dir}: {error.strerror}") from None


def _check_same_run(run_dir: Path, config_dict: dict, checkpoint: Path) -> None:
    saved_path = run_dir / "config.json"
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, ValueError):  # deleted, cut short, or a run from before config.json: the checkpoint's own
        saved = read_state(checkpoint).get("config")
        if saved is None:
            return  # a checkpoint from before it kept its config: nothing to compare against
        saved_path = checkpoint / "state.json"
        if isinstance(saved.get("model"), dict):  # kept as a worker placed it: model.device resolved ("cpu")
            saved = {**saved, "model": {**saved["model"], "device": config_dict.get("model", {}).get("device")}}
    if not _is_tlt_config(saved):
        raise RunDirError(f"{saved_path} is not a tlt config (JSON sections): cannot check that --resume "
                          f"continues the same run")
    keys = [(section, key) for section in MEANING_SECTIONS for key in sorted(config_dict.get(section, {}))]
    keys += [("run", key) for key in MEANING_RUN_KEYS]
    before = functools.partial(_saved_value, saved)
    now = functools.partial(_saved_value, config_dict)
    changed = {f"{section}.{key}": (_meaning(before, section, key), _meaning(now, section, key))
               for section, key in keys if f"{section}.{key}" not in OPERATIONAL_KEYS}
    changed = {name: values for name, values in changed.items() if values[0] != values[1]}
    hint = ""
    started_from, given = _same_path(before("run", "drafter"), "run"), _same_path(now("run", "drafter"), "run")
    # it would be loaded, then replaced by the checkpoint's drafter (found by a trial); a checkpoint without one
    # (SD was off) starts from it
    if given and given != started_from and read_state(checkpoint).get("drafter") is not None:
        changed["run.drafter"] = (started_from, given)
        hint = ("; run.drafter is the drafter a run starts from: --resume goes on with the one its checkpoint "
                "holds, so leave run.drafter out or as it was")
    if changed:
        if "optim.decay_steps" in changed and changed["optim.decay_steps"][0]:
            hint += (f"; its cosine schedule decays over {changed['optim.decay_steps'][0]} steps: set "
                    f"optim.decay_steps to that to train longer on the same schedule")
        if "task.reward" in changed:  # a reward function that failed: "fix it and --resume" (QA)
            hint += (f"; a fixed reward function resumes under its old name, "
                     f"task.reward={changed['task.reward'][0]}")
        shown = "; ".join(f"{name}: {json.dumps(old)} in the run, {json.dumps(new)} now"
                          for name, (old, new) in changed.items())
        raise RunDirError(f"--resume would continue the run in {run_dir} under a different config "
                          f"({shown}{hint}): keep those values, or start a new run with --overwrite or another "
                          f"run.out_dir")


# Fields whose default, when added, changed what a run does: a run started before them ran as this value
# (grpo.rollout_is: no importance weights). Resuming it under the new default is then a config change, named.
BEFORE_THE_FIELD = {("grpo", "rollout_is"): "off"}


def _saved_value(saved: dict, section: str, key: str):
    """A field the saved config lacks was added to tlt after that run started: it ran with the default (or as
    BEFORE_THE_FIELD says). (Fields the saved config has and this tlt lacks are ignored: they mean nothing now.)"""
    if key in saved.get(section, {}):
        return saved[section][key]
    if (section, key) in BEFORE_THE_FIELD:
        return BEFORE_THE_FIELD[section, key]
    return TrainConfig().to_dict()[section][key]


def _meaning(value_of, section: str, key: str):
    """A field's value as it shapes the run. optim.decay_steps: the cosine decay's length, 0 resolved to
    run.steps (which may otherwise change on --resume), and nothing under a constant schedule."""
    if (section, key) == ("optim", "decay_steps"):
        if value_of("optim", "schedule") != "cosine":
            return 0
        return value_of("optim", "decay_steps") or value_of("run", "steps")
    if (section, key) in PATH_KEYS:
        return _same_path(value_of(section, key), section)
    return _norm(value_of(section, key))


def config_text_to_keep(run_dir: Path, config_dict: dict) -> str:
    """config.json's text for a resumed run's config: its paths absolute (`_with_absolute_paths`), and
    run.drafter, when left out, the one the run started from (the checkpoint's drafter descends from it)."""
    config_dict = _with_absolute_paths(config_dict)
    if not config_dict.get("run", {}).get("drafter"):
        try:
            started_from = json.loads((run_dir / "config.json").read_text()).get("run", {}).get("drafter")
        except (OSError, ValueError, AttributeError):
            started_from = None
        config_dict["run"]["drafter"] = started_from
    return json.dumps(config_dict, indent=1)


def _with_absolute_paths(config_dict: dict) -> dict:
    """The config with its paths as the files they named when the run started: a relative model.path saved as
    given was resolved against the directory of each later --resume, so another directory's model of the same
    shape continued the run without a word (found by review)."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in config_dict.items()}
    for section, key in PATH_KEYS:
        value = out.get(section, {}).get(key)
        if isinstance(value, str) and value:
            out[section][key] = _same_path(value, section) or value  # a default model alias stays as given
    return out


def _same_path(value, section: str):
    """A path as the file it names: `./data/x.jsonl`, `data/x.jsonl` and its absolute form are one file, and
    model.path's default aliases (unset, `smollm2`) are one model."""
    if section == "model" and is_default_source(value):
        return None
    return value if value is None else os.path.abspath(os.path.expanduser(value))


def _norm(value):
    """JSON turns tuples into lists: compare the two forms as equal."""
    return list(value) if isinstance(value, tuple) else value
