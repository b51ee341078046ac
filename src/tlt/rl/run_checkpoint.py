"""A run's checkpoint: the one writer both drivers call, and the readers `--resume` uses.

One directory per checkpoint (rl/checkpoint.py writes it atomically): the policy, its optimizer (unless
run.save_optimizer=false), the lr schedule, RNG states and the step; in state.json also the run's config and the
speculation policy's state (the bandit's experience carries across steps); with a drafter, its latest version
(drafter.safetensors) and its trainer's optimizer state (drafter_optimizer.safetensors), so spot training goes on
where it stopped. The layout is the one runs have always written: older checkpoints resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tlt.drafter.trainer import OPTIMIZER_FILE as DRAFTER_OPTIMIZER_FILE
from tlt.drafter.trainer import save_trainer_state
from tlt.models.eagle import EagleDrafter
from tlt.optimizer_state import flatten_optimizer, unflatten_optimizer
from tlt.rl.checkpoint import CheckpointError, load_checkpoint, read_state, read_tensors, save_checkpoint
from tlt.rl.replica import PolicyReplica

DRAFTER_FILE = "drafter.safetensors"
FINAL_DRAFTER_DIR = "drafter"  # RUN_DIR/final/drafter: the run's last drafter, beside the final policy


@dataclass
class DrafterSnapshot:
    """The drafter a run serves: its version number, its own layers' weights, and its trainer's state
    ({"optimizer": state dict, "steps": optimizer steps}; None before any training)."""

    version: int
    weights: dict[str, torch.Tensor]
    trainer_state: dict | None = None
    trained: bool = True  # False: the run's starting drafter at its random initialization, never trained


def save_run_checkpoint(run_dir: Path, replica: PolicyReplica, step: int, *, drafter: DrafterSnapshot | None = None,
                        extra: dict | None = None) -> Path:
    """Write RUN_DIR/step-NNNNNN after `step` completed steps. `extra`: more state.json entries (the driver's)."""
    state, files = dict(extra or {}), {}
    if drafter is not None:
        files[DRAFTER_FILE] = drafter.weights
        state["drafter"] = {"version": drafter.version, "trainer": None, "trained": drafter.trained}
        if drafter.trainer_state is not None:
            tensors, meta = flatten_optimizer(drafter.trainer_state["optimizer"])
            files[DRAFTER_OPTIMIZER_FILE] = tensors
            state["drafter"]["trainer"] = {"steps": drafter.trainer_state["steps"], "optimizer": meta}
    state["config"] = replica.config.to_dict()
    if replica.reference_digest is not None:
        state["reference_digest"] = replica.reference_digest
    if replica.engine.speculation is not None:
        state["speculation"] = replica.engine.speculation.state_dict()
    optimizer = replica.optimizer if replica.config.run.save_optimizer else None
    return save_checkpoint(run_dir, step, replica.model, optimizer, state, files=files, scheduler=replica.scheduler)


def resume_replica(replica: PolicyReplica, checkpoint: Path, rank: int = 0) -> int:
    """Restore the policy, optimizer, lr schedule, RNG and speculation policy in place; returns the step. `rank`:
    the worker's, whose own speculation policy state the run's driver kept (`speculation_by_rank`: each worker's
    bandit learned its own batch sizes; a rank the checkpoint has none for takes rank 0's)."""
    saved_reference = read_state(checkpoint).get("reference_digest")
    if None not in (saved_reference, replica.reference_digest) and saved_reference != replica.reference_digest:
        # the KL reference is the model as loaded from model.path: other weights there would pull the resumed
        # policy toward another "initial policy" (a changed dataset is refused alike)
        raise CheckpointError(f"--resume: the model at model.path={replica.config.model.path} is not the one the run "
                              f"in {Path(checkpoint).parent} started from (its weights changed), and it is the KL "
                              f"reference (grpo.kl_coef > 0): restore those weights, or start a new run")
    state = load_checkpoint(checkpoint, replica.model, replica.optimizer, replica.scheduler)
    by_rank = state.get("speculation_by_rank") or []
    own = by_rank[rank] if rank < len(by_rank) and by_rank[rank] is not None else state.get("speculation")
    if own is not None and rank >= len(by_rank) and rank > 0:
        own = _without_totals(own)  # borrowed from rank 0: its bandit's experience, not its per-arm totals
    if own is not None and replica.engine.speculation is not None:
        replica.engine.speculation.load_state_dict(own)
    return state["step"]


def _without_totals(state: dict) -> dict:
    """A speculation state less its per-arm totals ("stats"): the step sums every worker's, so a rank that starts
    from rank 0's state would count rank 0's history once more (found by review)."""
    return {key: _without_totals(value) if isinstance(value, dict) else value
            for key, value in state.items() if key != "stats"}


def read_drafter(checkpoint: Path) -> DrafterSnapshot | None:
    """The checkpoint's drafter, or None when its run had none."""
    path = Path(checkpoint)
    meta = read_state(path).get("drafter")
    if meta is None or not (path / DRAFTER_FILE).exists():
        return None
    trainer = None
    if meta["trainer"] is not None:
        optimizer = unflatten_optimizer(read_tensors(path / DRAFTER_OPTIMIZER_FILE), meta["trainer"]["optimizer"])
        trainer = {"optimizer": optimizer, "steps": meta["trainer"]["steps"]}
    # a checkpoint from before "trained" was kept: a version past 0, or one with a trainer state, has trained
    trained = meta.get("trained", meta["version"] > 0 or trainer is not None)
    return DrafterSnapshot(meta["version"], read_tensors(path / DRAFTER_FILE), trainer, trained)


def save_final_drafter(directory: Path, target_config, snapshot: DrafterSnapshot) -> Path:
    """The run's latest drafter as a tlt drafter directory (config, weights and, once spot training has run,
    its trainer state): `tlt drafter export` makes it an EAGLE draft model for vLLM / SGLang, and
    `run.drafter=` starts the next run's spot training where this one stopped. `target_config`: the policy's,
    which the saved config is made from (a run.drafter made for another target of the same shapes, e.g. another
    RoPE, is saved with this one's: what it drafted with here); the layer and the draft vocabulary are the
    snapshot's own (a resumed run's may differ from what a new drafter gets)."""
    draft_vocab = snapshot.weights.get("draft_to_target")
    draft_vocab = None if draft_vocab is None else draft_vocab.cpu()
    # unattached, on the CPU: only its own layers are written
    drafter = EagleDrafter.for_weights(target_config, snapshot.weights, draft_vocab)
    drafter.load_state_dict(snapshot.weights)
    drafter.save(directory)
    if snapshot.trainer_state is not None:
        save_trainer_state(directory, snapshot.trainer_state)
    return Path(directory)
