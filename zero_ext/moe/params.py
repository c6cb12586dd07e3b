"""``deepspeed.moe.utils``'s optimizer-group splitter, for code that builds its optimizer groups with it.

DeepSpeed moves each mixture-of-experts expert parameter (one whose ``allreduce`` attribute is False:
it is reduced over its expert-parallel group, not the whole data-parallel group) into extra groups, one
per expert group. zero_ext has no expert parallelism, so there is nothing to move: the groups come back
as they were, and a group holding an expert parameter is refused, naming it.
"""
from typing import Any, Dict, List, Sequence, Tuple, Union

import torch

# DeepSpeed's default cap on the elements of one expert group (unused here: no expert groups are made).
DEFAULT_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is marked as an expert parameter (``param.allreduce`` exists and is False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Union[Dict[str, Any], Tuple[Dict[str, Any], ...], List[Dict[str, Any]]],
        max_group_size: Union[int, float, None] = DEFAULT_MAX_GROUP_SIZE) -> List[Dict[str, Any]]:
    """The optimizer groups, unchanged: a list (one dict, or a tuple of them, becomes a list of the same
    dicts), each group's ``params`` made a list. An expert parameter in any group is a
    NotImplementedError naming the group and the parameter: zero_ext has no expert parallelism."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"param_groups must be a dict, a list or a tuple of dicts, got {type(param_groups).__name__}")
    for i, group in enumerate(groups):
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = params
        for j, p in enumerate(params):
            if is_moe_param(p):
                name = group.get("name", f"#{i}")
                raise NotImplementedError(
                    f"split_params_into_different_moe_groups_for_optimizer: optimizer group {name!r} holds an "
                    f"expert (MoE) parameter (params[{j}], shape {tuple(p.shape)}, allreduce=False, group_name="
                    f"{getattr(p, 'group_name', None)!r}); zero_ext has no expert parallelism, so expert "
                    "parameters cannot be given their own groups. Remove the allreduce=False mark to train "
                    "them as ordinary data-parallel parameters.")
    return groups


__all__: Sequence[str] = ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param"]
