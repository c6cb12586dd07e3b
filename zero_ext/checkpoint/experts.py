"""Mixture-of-experts weights in a checkpoint: one file per expert, DeepSpeed's layout.

The ranks of an expert-parallel group hold different experts, under the same local names
(``...deepspeed_experts.<i>...``), so rank 0's module state cannot hold them. As DeepSpeed does, each
expert is written to a file of its own, ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt`` (L: the MoE
layer's index in module order, E: the global expert id), by the first rank of its expert-data-parallel
group, under its global name (``...deepspeed_experts.<E>...``); the model file keeps the rest. Loading,
each rank reads the files of its own experts and renames them back to its local names. Global expert
E = ep_rank * num_local_experts + i (zero_ext/moe/layer.py).

The optimizer partitions of expert groups are in the ranks' optimizer files as any other; a checkpoint
with expert-parallel groups loads into the same world size and expert-parallel sizes only (their
partitions are not resharded).
"""
import re
from typing import Any, Dict, Iterator, List, Tuple

import torch

from .. import comm

_EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


def expert_file(layer: int, expert: int) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"


def _layers(module: torch.nn.Module) -> Iterator[Tuple[int, str, Any]]:
    """(index, prefix of its expert keys, layer) of each MoE layer, in module order."""
    from ..optim.experts import moe_layers  # (here: the engine imports this package before optim's)
    names = {id(m): n for n, m in module.named_modules()}
    for k, layer in enumerate(moe_layers(module)):
        name = names[id(layer)]
        yield k, (name + _EXPERTS) if name else _EXPERTS[1:], layer


def _ranks(layer) -> Tuple[int, int]:
    """(rank in the layer's expert-parallel group, rank in its expert-data-parallel group)."""
    from ..moe import groups
    if not comm.is_initialized():
        return 0, 0
    name = layer.expert_group_name
    return (comm.get_rank(groups.expert_parallel_group(name)),
            comm.get_rank(groups.expert_data_parallel_group(name)))


def _local(key: str, prefix: str) -> Tuple[int, str]:
    """(local expert index, the rest of the key) of a key under ``prefix``."""
    m = re.match(r"(\d+)\.(.*)", key[len(prefix):])
    return int(m.group(1)), m.group(2)


def is_expert_key(module: torch.nn.Module, key: str) -> bool:
    return any(key.startswith(prefix) for _, prefix, _ in _layers(module))


def expert_states(module: torch.nn.Module, sd: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
    """file name -> {global key: value} of the experts this rank writes (those whose expert-data-parallel
    group it leads); ``sd``: this rank's module state."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for k, prefix, layer in _layers(module):
        ep_rank, edp_rank = _ranks(layer)
        if edp_rank != 0:
            continue
        for key, value in sd.items():
            if key.startswith(prefix):
                i, rest = _local(key, prefix)
                expert = ep_rank * layer.num_local_experts + i
                # (a copy: the value is a view of a flat buffer, which torch.save would write whole)
                out.setdefault(expert_file(k, expert), {})[f"{prefix}{expert}.{rest}"] = value.detach().clone()
    return out


def with_every_expert(module: torch.nn.Module, sd: Dict[str, torch.Tensor], dst: int = 0) -> Dict[str, torch.Tensor]:
    """``sd`` (this rank's module state) with the local experts replaced, on rank ``dst``, by every expert
    of every MoE layer under its global name: the whole model, loadable into the same model built with
    ep_size 1 (the 16-bit export). Collective; the other ranks get ``sd`` back."""
    mine = {k: v.cpu() for part in expert_states(module, sd).values() for k, v in part.items()}
    everyone = [None] * comm.get_world_size() if comm.get_rank() == dst else None
    comm.gather_object(mine, everyone, dst=dst)
    if everyone is None:
        return sd
    out = {k: v for k, v in sd.items() if not is_expert_key(module, k)}
    for part in everyone:
        out.update(part)
    return out


def load_expert_states(module: torch.nn.Module, read) -> Dict[str, torch.Tensor]:
    """{local key: value} of this rank's experts, from their files (``read(file name)``: its state)."""
    out: Dict[str, torch.Tensor] = {}
    for k, prefix, layer in _layers(module):
        ep_rank, _ = _ranks(layer)
        for i in range(layer.num_local_experts):
            expert = ep_rank * layer.num_local_experts + i
            for key, value in read(expert_file(k, expert)).items():
                out[f"{prefix}{i}.{key[len(prefix) + len(str(expert)) + 1:]}"] = value
    return out


def expert_layout(engine) -> List[Dict[str, Any]]:
    """Per MoE layer: its expert-parallel size and expert count (for the manifest: a checkpoint loads
    only where these match)."""
    return [{"ep_size": layer.ep_size, "num_experts": layer.num_experts} for _, _, layer in _layers(engine.module)]
