"""Which parameters are experts, and the optimizer groups they need (``deepspeed.moe.utils``).

A mixture-of-experts expert parameter (zero_ext/moe/layer.py) has ``allreduce = False`` and a
``group_name`` (``"ep_size_E"``): it is reduced over its expert-data-parallel group, not the whole
data-parallel group, so ZeRO keeps it in optimizer groups of its own (zero_ext/optim/experts.py). These are the
functions scripts build those groups with, as DeepSpeed's.
"""
from typing import Any, Dict, List, Sequence, Tuple, Union

import torch

# DeepSpeed's default cap on the elements of one expert optimizer group
DEFAULT_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is marked as an expert parameter (``param.allreduce`` exists and is False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: Dict[str, Any]) -> bool:
    """Whether an optimizer group is one of the expert groups made below (``"moe": True``)."""
    return bool(param_group.get("moe", False))


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Union[Dict[str, Any], Tuple[Dict[str, Any], ...], List[Dict[str, Any]]],
        max_group_size: Union[int, float, None] = DEFAULT_MAX_GROUP_SIZE) -> List[Dict[str, Any]]:
    """The optimizer groups with every expert parameter moved out of its group into new groups, one per
    (original group, expert group name), each cut into runs of at most ``max_group_size`` elements
    (None: not cut). A new group copies its original group's options and gets ``name`` = the expert group
    name and ``moe = True``; it follows the original groups, which keep their other parameters (an
    original group left empty stays, as DeepSpeed leaves it). The groups are changed in place and
    returned as a list (one dict, or a tuple of them, becomes a list)."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"param_groups must be a dict, a list or a tuple of dicts, got {type(param_groups).__name__}")
    added: List[Dict[str, Any]] = []
    for group in groups:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        experts: Dict[str, List[torch.nn.Parameter]] = {}
        for p in params:
            if is_moe_param(p):
                experts.setdefault(p.group_name, []).append(p)
        group["params"] = [p for p in params if not is_moe_param(p)]
        for name, members in experts.items():
            for run in _runs(members, max_group_size):
                added.append({**group, "name": name, "moe": True, "params": run})
    return groups + added


def _runs(params: List[torch.nn.Parameter], cap: Union[int, float, None]) -> List[List[torch.nn.Parameter]]:
    """``params`` in order, cut so that no run but a single oversized parameter exceeds ``cap`` elements."""
    if cap is None:
        return [params]
    runs: List[List[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        if runs and size + p.numel() <= cap:
            runs[-1].append(p)
            size += p.numel()
        else:
            runs.append([p])
            size = p.numel()
    return runs


def configure_moe_param_groups(model_parameters: List[Any]) -> List[Dict[str, Any]]:
    """DeepSpeed's engine helper: parameters (or groups without expert groups yet) -> groups with the
    expert parameters split out; groups that already have expert groups come back as they are."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    if not model_parameters:
        return model_parameters
    first = model_parameters[0]
    if isinstance(first, torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


__all__: Sequence[str] = ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param",
                          "is_moe_param_group", "configure_moe_param_groups"]
