"""Checkpoints of an RL run: policy weights, optimizer state, RNG states and the step, all as safetensors + JSON.

Never pickle: optimizer tensors go to safetensors under flat names, everything else to JSON. A checkpoint is
written to a temporary directory and renamed into place, so a run killed mid-save keeps its last good one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model

from tlt.errors import TltError, first_line
from tlt.files import file_crc32, share_as_umask
from tlt.models.model_files import add_legacy_keys
from tlt.optimizer_state import fit_param_groups, fit_scheduler_groups, flatten_optimizer, unflatten_optimizer

CHECKPOINT_PREFIX = "step-"
RETIRED_PREFIX = ".old-"  # an earlier copy renamed aside while its replacement moves in (_swap_in)
log = logging.getLogger(__name__)


class CheckpointError(TltError):
    """A checkpoint that is missing or does not fit the model being resumed."""


def save_checkpoint(run_dir: Path, step: int, model, optimizer, extra: dict | None = None,
                    files: dict[str, dict[str, torch.Tensor]] | None = None, scheduler=None) -> Path:
    """Write checkpoint-NNNNNN atomically (staged, then renamed). `files`: extra safetensors files by name.
    The lr scheduler's state (a few numbers) is kept even without the optimizer's, so the schedule continues."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / f"{CHECKPOINT_PREFIX}{step:06d}"
    with _staged(target, ".ckpt-", f"the checkpoint of step {step}") as staging:
        save_model(model, str(staging / "policy.safetensors"))
        meta = None
        if optimizer is not None:  # None: a smaller checkpoint; resuming starts a fresh optimizer
            tensors, meta = flatten_optimizer(optimizer.state_dict())
            save_file(tensors, str(staging / "optimizer.safetensors"))
        save_file({"torch_rng": torch.get_rng_state()}, str(staging / "rng.safetensors"))
        for name, tensors in (files or {}).items():
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(staging / name))
        state = {"step": step, "optimizer": meta, "python_rng": _python_rng_state(), **(extra or {})}
        state[CRC_KEY] = {file.name: file_crc32(file) for file in sorted(staging.glob("*.safetensors"))}
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        (staging / "state.json").write_text(json.dumps(state, indent=1))
    return target


@contextlib.contextmanager
def _staged(target: Path, prefix: str, what: str):
    """A staging directory beside `target`, renamed onto it when the block succeeds (removed when it fails):
    a run killed mid-save keeps its last complete copy. A write that fails (a full disk, a quota) is one
    CheckpointError naming `what` was being saved and the checkpoint that is still whole."""
    # mkdir, not mkdtemp: the directory becomes the checkpoint or final/, and mkdtemp's 0700 would hide the
    # trained policy from everyone but its owner (a serving container, a colleague)
    staging = target.parent / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        yield staging
        share_as_umask(staging)
        _swap_in(staging, target)
    except OSError as error:
        raise _save_error(what, target, error) from None
    except SafetensorError as error:
        if "I/O error" not in str(error):
            raise  # not the disk: a tensor safetensors cannot store is a bug to see whole
        raise _save_error(what, target, error) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(staging: Path, target: Path) -> None:
    """Rename `staging` onto `target`. An earlier copy there (final/ of a run resumed for more steps) is renamed
    aside first and deleted last: deleting it in place, a kill could leave a half-deleted model directory; now
    a kill leaves it whole under its retired name, and `recover_retired` puts it back."""
    retired = None
    if target.exists():
        retired = target.parent / f"{RETIRED_PREFIX}{target.name}-{uuid.uuid4().hex[:8]}"
        os.replace(target, retired)
    os.replace(staging, target)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def recover_retired(run_dir: Path) -> None:
    """What a save killed mid-swap left (see _swap_in): an earlier copy whose replacement never arrived goes
    back in place; one whose replacement did (or a half-deleted one) is deleted."""
    for retired in sorted(Path(run_dir).glob(f"{RETIRED_PREFIX}*-*")):
        target = retired.with_name(retired.name[len(RETIRED_PREFIX):].rsplit("-", 1)[0])
        if target.exists() or not retired.is_dir():
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(retired, target)
            log.warning("put back %s: a save killed while replacing it had renamed it aside", target)


def _save_error(what: str, target: Path, error: Exception) -> CheckpointError:
    kept = latest_checkpoint(target.parent)
    reason = error.strerror if isinstance(error, OSError) and error.strerror else first_line(error)
    whole = (f"the last complete checkpoint, {kept.name}, is intact: `tlt train ... --resume` continues from it"
             if kept is not None else "no complete checkpoint was saved before it")
    return CheckpointError(f"cannot save {what} in {target.parent}: {reason} ({whole})")


def save_final_model(model, tokenizer, directory: Path, *, also=None) -> Path:
    """The trained policy as a Hugging Face model directory (config, safetensors weights, tokenizer) that
    `AutoModelForCausalLM.from_pretrained` loads; written to a staging directory and renamed into place.
    `also(staging)` writes more into it first (the run's drafter), so the final directory is whole or absent."""
    directory = Path(directory)
    with _staged(directory, ".final-", "the final policy") as staging, _no_progress_bars():
        model.save_pretrained(str(staging), safe_serialization=True)
        add_legacy_keys(staging)  # `vllm serve RUN/final` on transformers 4 reads rope_theta, not rope_parameters
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(staging))
        if also is not None:
            also(staging)
    return directory


@contextlib.contextmanager
def _no_progress_bars():
    """transformers draws a 'Writing model shards' bar for a one-shard save: noise between a run's step lines."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (keep <= 0: keep all); returns the deleted ones."""
    if keep <= 0:
        return []
    found = _complete_checkpoints(run_dir)
    doomed = found[:-keep]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = _complete_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories, `step-` and digits exactly, in step order: a user's `step-notes/` or
    `step-000003-good/` backup is neither resumed from, pruned nor cleared."""
    found = [p for p in Path(run_dir).glob(f"{CHECKPOINT_PREFIX}*")
             if p.is_dir() and re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)]
    return sorted(found, key=checkpoint_step)


def _named_step(checkpoint: Path) -> int | None:
    """The step a checkpoint directory's name says (step-NNNNNN), None for another name (a copy elsewhere)."""
    digits = checkpoint.name[len(CHECKPOINT_PREFIX):]
    return int(digits) if checkpoint.name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else None


def checkpoint_step(checkpoint: Path) -> int:
    """The completed steps a checkpoint holds, from its name (step-NNNNNN)."""
    return int(Path(checkpoint).name[len(CHECKPOINT_PREFIX):])


def _complete_checkpoints(run_dir: Path) -> list[Path]:
    return [p for p in checkpoint_dirs(run_dir) if (p / "state.json").exists()]


def load_checkpoint(path: Path, model, optimizer, scheduler=None) -> dict:
    """Restore weights in place (the rollout engine keeps sharing them), optimizer, lr schedule and RNG; returns
    state.json. A checkpoint from before schedules were saved leaves the scheduler to catch up by step count."""
    path = Path(path)
    if not (path / "state.json").exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no state.json)")
    state = read_state(path)
    weights = read_tensors(path / "policy.safetensors")
    own = model.state_dict()
    missing = [name for name in own if name not in weights and not _saved_under_another_name(own, weights, name)]
    if missing or any(weights[n].shape != own[n].shape for n in weights if n in own):
        raise CheckpointError(f"{path}: weights do not fit this model (missing {missing[:3]}...)")
    with torch.no_grad():
        for name, tensor in weights.items():
            if name in own:
                own[name].copy_(tensor)
    if state.get("optimizer") is None:
        log.warning("%s holds no optimizer state (run.save_optimizer=false): the optimizer starts fresh", path)
    optimizer_tensors = None if state.get("optimizer") is None else read_tensors(path / "optimizer.safetensors")
    rng = read_tensors(path / "rng.safetensors")
    try:  # state.json's values as torch and random take them: an edited or damaged one fails here, named
        if optimizer_tensors is not None:
            saved = unflatten_optimizer(optimizer_tensors, state["optimizer"])
            optimizer.load_state_dict(fit_param_groups(saved, optimizer, list(model.parameters())))
        if scheduler is not None and state.get("scheduler") is not None:
            scheduler.load_state_dict(fit_scheduler_groups(state["scheduler"], optimizer))
        torch.set_rng_state(rng["torch_rng"])
        random.setstate(_as_python_rng_state(state["python_rng"]))
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
        raise _damaged(path / "state.json", f"{type(error).__name__}: {first_line(error)}") from None
    return state


def read_state(checkpoint: Path) -> dict:
    """A checkpoint's state.json; a damaged one (cut short, not JSON, no step) is a CheckpointError naming it."""
    file = Path(checkpoint) / "state.json"
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as error:  # ValueError: bad JSON or bytes that are not UTF-8
        raise _damaged(file, first_line(error)) from None
    if not isinstance(state, dict) or not {"step", "python_rng"} <= set(state):
        raise _damaged(file, "not a tlt checkpoint state (no step or RNG state)")
    if not isinstance(state["step"], int) or isinstance(state["step"], bool) or state["step"] < 0:
        raise _damaged(file, f"its step is {state['step']!r}, not a count of steps")
    named = _named_step(Path(checkpoint))
    if named is not None and state["step"] != named:  # an edited state.json: resumed as step 2 from step-000004
        raise _damaged(file, f"its step is {state['step']}, but its directory is {Path(checkpoint).name}")
    scheduler = state.get("scheduler")
    last_epoch = scheduler.get("last_epoch", 0) if isinstance(scheduler, dict) else None
    if scheduler is not None and (not isinstance(last_epoch, int) or isinstance(last_epoch, bool)):
        raise _damaged(file, f"its lr schedule state {scheduler!r} holds no step count (last_epoch)")
    return state


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors, checked against the CRC32 its state.json keeps of each file (when it keeps one)."""
    expected = _saved_crc32(path)
    try:
        if expected is not None and file_crc32(path) != expected:
            raise _damaged(path, "its bytes are not those written (CRC32 differs): the file was damaged after the "
                                 "save")
        return load_file(str(path))
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - safetensors raises several types for missing/corrupt files
        raise _damaged(path, first_line(error)) from None


# state.json's CRC32 of each safetensors file beside it: bytes changed inside a file of intact size and header
# (a disk or copy error) loaded without a word, and training went on from damaged weights (found by QA)
CRC_KEY = "crc32"


def _saved_crc32(path: Path) -> int | None:
    try:
        saved = json.loads((path.parent / "state.json").read_text()).get(CRC_KEY) or {}
    except (OSError, ValueError, AttributeError):
        return None  # read_state names a damaged state.json
    value = saved.get(path.name) if isinstance(saved, dict) else None
    return value if isinstance(value, int) else None


def _damaged(file: Path, detail: str) -> CheckpointError:
    """The error for an unreadable file of a checkpoint, saying what to do: resuming again would meet it again."""
    checkpoint = file.parent
    earlier = [p for p in _complete_checkpoints(checkpoint.parent) if p.name < checkpoint.name]
    move = (f"delete {checkpoint} to resume from {earlier[-1].name}" if earlier else
            "start over with --overwrite, or set another run.out_dir")
    return CheckpointError(f"cannot read checkpoint file {file}: {detail}; {move}")



def _saved_under_another_name(own: dict, weights: dict, name: str) -> bool:
    """Tied tensors (e.g. embed_tokens and lm_head) share storage; safetensors keeps one of their names, and
    which one is its choice: a missing name is fine when a tensor it shares storage with was saved."""
    pointer = own[name].data_ptr()
    return any(other in weights and tensor.data_ptr() == pointer for other, tensor in own.items() if other != name)


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _as_python_rng_state(saved: list) -> tuple:
    return saved[0], tuple(saved[1]), saved[2]
