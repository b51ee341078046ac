"""Checkpoints of an RL run: policy weights, optimizer state, RNG states and the step, all as safetensors + JSON.

Never pickle: optimizer tensors go to safetensors under flat names, everything else to JSON. A checkpoint is
written to a temporary directory and renamed into place, so a run killed mid-save keeps its last good one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file, save_model

from tlt.errors import TltError

CHECKPOINT_PREFIX = "step-"


class CheckpointError(TltError):
    """A checkpoint that is missing or does not fit the model being resumed."""


def save_checkpoint(run_dir: Path, step: int, model, optimizer, extra: dict | None = None,
                    files: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write checkpoint-NNNNNN atomically (staged, then renamed). `files`: extra safetensors files by name."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / f"{CHECKPOINT_PREFIX}{step:06d}"
    staging = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=run_dir))
    try:
        save_model(model, str(staging / "policy.safetensors"))
        tensors, meta = _flatten_optimizer(optimizer.state_dict())
        save_file(tensors, str(staging / "optimizer.safetensors"))
        save_file({"torch_rng": torch.get_rng_state()}, str(staging / "rng.safetensors"))
        for name, tensors in (files or {}).items():
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(staging / name))
        state = {"step": step, "optimizer": meta, "python_rng": _python_rng_state(), **(extra or {})}
        (staging / "state.json").write_text(json.dumps(state, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted(p for p in Path(run_dir).glob(f"{CHECKPOINT_PREFIX}*") if (p / "state.json").exists())
    return found[-1] if found else None


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore weights in place (the rollout engine keeps sharing them), optimizer and RNG; returns state.json."""
    path = Path(path)
    if not (path / "state.json").exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no state.json)")
    weights = load_file(str(path / "policy.safetensors"))
    own = model.state_dict()
    missing = [name for name in own if name not in weights and not _is_tied_alias(model, name)]
    if missing or any(weights[n].shape != own[n].shape for n in weights if n in own):
        raise CheckpointError(f"{path}: weights do not fit this model (missing {missing[:3]}...)")
    with torch.no_grad():
        for name, tensor in weights.items():
            if name in own:
                own[name].copy_(tensor)
    state = json.loads((path / "state.json").read_text())
    optimizer.load_state_dict(_unflatten_optimizer(load_file(str(path / "optimizer.safetensors")),
                                                   state["optimizer"]))
    torch.set_rng_state(load_file(str(path / "rng.safetensors"))["torch_rng"])
    random.setstate(_as_python_rng_state(state["python_rng"]))
    return state


def _flatten_optimizer(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for index, values in state_dict["state"].items():
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{name}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def _is_tied_alias(model, name: str) -> bool:
    return name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _as_python_rng_state(saved: list) -> tuple:
    return saved[0], tuple(saved[1]), saved[2]
