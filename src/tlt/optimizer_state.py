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
