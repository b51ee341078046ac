"""How the policy is optimized: AdamW, the lr schedule, activation checkpointing and the training forward's
precision (`optim.*`).

The schedule runs over RL steps (every `grpo.updates_per_step` pass of a step uses the same lr, as in verl) and
is a `torch.optim.lr_scheduler.LambdaLR`, whose state the checkpoint keeps, so a resumed run continues the exact
lr sequence. It advances lazily, when the update of step k starts (`advance_schedule`): the optimizer's lr is then
always the lr of the last update, which is what the step's metrics report.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from tlt.errors import TltError
from tlt.lr_schedule import lr_factor


def build_optimizer(model, optim) -> torch.optim.Optimizer:
    """AdamW; weight decay (when set) on the matrices only: norm weights and biases are not decayed, as in the
    Hugging Face Trainer (hence TRL)."""
    params = list(model.parameters())  # each shared (tied) parameter once
    if optim.weight_decay == 0:
        return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=0.0)
    decayed = [p for p in params if p.ndim >= 2]
    kept = [p for p in params if p.ndim < 2]
    groups = [{"params": decayed, "weight_decay": optim.weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr, betas=optim.betas)


def decay_steps(optim, run_steps: int) -> int:
    """The cosine schedule's horizon in RL steps."""
    return optim.decay_steps or run_steps


def trains_past_its_decay(optim, run_steps: int) -> bool:
    """A cosine without a floor that ends before run.steps: the steps past it train at lr 0."""
    return optim.schedule == "cosine" and optim.min_lr_ratio == 0 and decay_steps(optim, run_steps) < run_steps


def build_scheduler(optimizer, config) -> torch.optim.lr_scheduler.LambdaLR:
    """From a TrainConfig; sets the lr of step 0 on the optimizer."""
    optim = config.optim
    factor = functools.partial(lr_factor, schedule=optim.schedule, warmup_steps=optim.warmup_steps,
                               horizon=decay_steps(optim, config.run.steps), min_lr_ratio=optim.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def advance_schedule(scheduler, step: int) -> None:
    """Bring the schedule to RL step `step` before its update (one scheduler step per RL step). torch warns when
    a scheduler steps before its optimizer has in this process, as after a resume: here that order is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        while scheduler.last_epoch < step:
            scheduler.step()


def enable_grad_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward. Transformers checkpoints only in train mode, so
    the no-grad log-prob pass (eval mode) and the rollout engine (its own forward) are untouched."""
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None)
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise TltError(f"optim.grad_checkpointing=true: {type(model).__name__} does not support gradient "
                       f"checkpointing")
    enable({"use_reentrant": False})


def disable_dropout(model) -> bool:
    """Zero every dropout of the policy; True when one was on. The rollout samples and the old log-probs come from
    dropout-free forwards, the update's from a train-mode one: with dropout on, the first pass's ratio is not 1
    and the gradient is of a perturbed policy (TRL's `disable_dropout`; Llama/Qwen checkpoints ship 0)."""
    found = False
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p, found = 0.0, True
        rate = getattr(module, "attention_dropout", None)  # transformers' attention keeps the config's as a float
        if isinstance(rate, float) and rate > 0:
            module.attention_dropout, found = 0.0, True
    if getattr(model.config, "attention_dropout", 0.0):
        model.config.attention_dropout, found = 0.0, True
    return found


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """optim.autocast resolved for the policy's device: bf16, or None (no autocast)."""
    if setting == "off" or (setting == "auto" and torch.device(device).type != "cuda"):
        return None
    return torch.bfloat16


def training_autocast(dtype: torch.dtype | None, device: torch.device):
    """The context the training and log-prob forwards run in."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)
