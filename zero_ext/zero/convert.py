"""Turning whole parameters into ZeRO-3 parameters: cut rank 0's value into pieces, keep this rank's.

Used by zero.Init (as each module's constructor returns, and for ``Init(module=...)``) and by
ZeroModel (for parameters a model still holds whole). Collective: every rank converts the same
parameters in the same order.
"""
import os
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

from .._native import planner
from . import collectives, internal, mics
from ..accelerator import compute_device
from .fetch import FetchSite, check_agreement
from .param import ZeroParam, align_ds_ids, is_zero_param, next_ds_id, peek_ds_id
from .status import FetchKind


def local_device() -> torch.device:
    """The device this rank computes on (accelerator.compute_device)."""
    return compute_device()


def resolve_group(data_parallel_group=None, mpu=None):
    """The group parameters are partitioned over: the one given, the mpu's data-parallel group, or the
    default (world) group (None)."""
    if data_parallel_group is not None:
        return data_parallel_group
    if mpu is not None:
        return mpu.get_data_parallel_group()
    return None


def shard_device(remote_device, compute: torch.device) -> torch.device:
    """Where pieces live: ``remote_device`` ("cpu") when given, else next to the computation. "nvme":
    made in host memory, then written to swap files at once (zero.Init) or at initialize."""
    if remote_device in (None, "none"):
        return compute
    device = str(getattr(remote_device, "value", remote_device))
    if device == "nvme":
        return torch.device("cpu")
    return torch.device(device)


def partition_params(params: Iterable[torch.nn.Parameter], group=None, remote_device=None,
                     pin_memory: bool = False, src_group_rank: int = 0,
                     compute: Optional[torch.device] = None) -> List[ZeroParam]:
    """Partition each parameter that is not one already, in order: its value on ``src_group_rank`` is
    cut into pieces and each rank keeps its own (padding zeroed); ``param.data`` becomes empty.
    ``compute``: the device the parameters compute on (default: where each is); a parameter held
    elsewhere (a model built in host memory) is cut where it is and only its piece moves."""
    with internal.section():
        return _partition_params(params, group, remote_device, pin_memory, src_group_rank, compute)


def _partition_params(params, group, remote_device, pin_memory, src_group_rank, compute=None) -> List[ZeroParam]:
    rank, world = collectives.rank_and_world(group)
    params = list({id(p): p for p in params if not is_zero_param(p)}.values())  # a parameter may come twice
    if not params:
        return []
    if world > 1:  # the scatters below must match in size: agree first ([Note: fetch-order agreement])
        rows = check_agreement(FetchSite(FetchKind.PARTITION), [p.shape for p in params], peek_ds_id(), group,
                               collectives.check_device(group, params[0].device))
        align_ds_ids(max(row[-1] for row in rows))
    layout = mics.of(group)  # MiCS (zero/mics.py): pieces replicated over the shard groups
    replicas = layout.replica_group if layout is not None and layout.replicas > 1 else None
    converted = []
    for p in params:  # one at a time: the whole value never goes to the compute device
        home = p.device
        piece = torch.empty(planner.shard_numel(p.numel(), world), dtype=p.dtype, device=home)
        with torch.no_grad():
            collectives.scatter_pieces(p.data, piece, src_group_rank, group)
            if replicas is not None:  # MiCS: the other shard groups take shard group 0's pieces
                collectives.broadcast(piece, 0, replicas)
        target = shard_device(remote_device, compute or home)
        if target != home:
            piece = piece.to(target)
        if pin_memory and target.type == "cpu" and torch.cuda.is_available():
            piece = piece.pin_memory()
        converted.append(ZeroParam(p, next_ds_id(), group, rank, world, piece, compute or home))
    return converted


def partition_module(module: torch.nn.Module, group=None, remote_device=None, pin_memory: bool = False,
                     device: Optional[torch.device] = None) -> List[ZeroParam]:
    """Partition every parameter of an already built model (rank 0's values win), parameter by
    parameter from where it is (host memory: only each piece moves to the compute device, so the whole
    model never lands there), and move its buffers to the compute device."""
    device = device or local_device()
    if device.type != "cpu":
        for m in module.modules():
            for name, b in list(m.named_buffers(recurse=False)):
                if b.device != device:
                    setattr(m, name, b.to(device))  # Module.__setattr__ keeps it a buffer
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    converted = partition_params([p for p in module.parameters()], group, remote_device, pin_memory,
                                 compute=device)
    for zp in converted:
        zp.rename(names[id(zp.param)])  # (ZeroModel renames too, from its root)
    return converted


def single_rank_group_error(dp_world_size: int, explicit_process_group=None, env=None) -> Optional[str]:
    """DeepSpeed's guard (its issue 8084), as a message or None: a launcher started several processes
    (``WORLD_SIZE`` in ``env``, default os.environ) but the group zero.Init partitions over has one rank,
    so every rank would silently hold the whole model. A one-rank group passed explicitly is taken as
    meant; a WORLD_SIZE that is not a number is no evidence either way."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    try:
        launched = int((os.environ if env is None else env).get("WORLD_SIZE") or 0)
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zero_ext: the launcher reports WORLD_SIZE={launched} but zero.Init's process group has one rank "
            "(torch.distributed was initialised alone, e.g. by from_pretrained before init_distributed), so "
            "parameters would not be partitioned and every rank would hold the whole model. Initialise the "
            "process group with every rank (zero_ext.init_distributed()) before zero.Init, or pass "
            "data_parallel_group if a one-rank group is meant.")


def check_single_rank_group(group) -> None:
    """Raises single_rank_group_error's message for the default (world) group."""
    if dist.is_initialized():
        problem = single_rank_group_error(dist.get_world_size(group), group)
        if problem is not None:
            raise RuntimeError(problem)