"""Optimizer state to and from safetensors + JSON (checkpoints of the policy's and the drafter's optimizers)."""

from __future__ import annotations

import torch


def flatten_optimizer(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's state_dict as (tensors for safetensors, JSON-able rest): no pickle anywhere."""
    tensors, scalars = {}, {}
    for index, values in state_dict["state"].items():
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{name}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """The inverse of `flatten_optimizer`: a state_dict for `optimizer.load_state_dict`."""
    state: dict[int, dict] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def fit_param_groups(state_dict: dict, optimizer: torch.optim.Optimizer, params: list) -> dict:
    """A state_dict saved with one parameter group (every parameter in `params` order), fitted to an optimizer
    that splits the same parameters into several groups (weight decay on matrices only, since 2026-11): torch
    matches saved and current parameters by position within each group. Any other state_dict is returned as is."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != 1 or len(optimizer.param_groups) == 1:
        return state_dict
    position = {id(p): i for i, p in enumerate(params)}
    saved_ids = saved_groups[0]["params"]
    state, groups, index = {}, [], 0
    for group in optimizer.param_groups:
        ids = []
        for param in group["params"]:
            old = saved_ids[position[id(param)]]
            if old in state_dict["state"]:
                state[index] = state_dict["state"][old]
            ids.append(index)
            index += 1
        groups.append({**saved_groups[0], "weight_decay": group["weight_decay"], "params": ids})
    return {"state": state, "param_groups": groups}


def fit_scheduler_groups(state_dict: dict, optimizer: torch.optim.Optimizer) -> dict:
    """An lr scheduler's state saved for one parameter group, for an optimizer of several (as
    `fit_param_groups`): every group shares the one lr, so its per-group lists repeat it (a one-entry base_lrs
    made the first scheduler step after the resume fail: found by review)."""
    groups = len(optimizer.param_groups)
    fitted = dict(state_dict)
    for key in ("base_lrs", "_last_lr"):
        values = state_dict.get(key)
        if isinstance(values, list) and len(values) == 1 and groups > 1:
            fitted[key] = values * groups
    return fitted
