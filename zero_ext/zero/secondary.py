"""ZeRO++ hpZ: a secondary partition of each parameter inside a node, so that the backward pass gathers
within the node instead of across the whole data-parallel group.

[Note: hpZ secondary partition]
With ``zero_hpz_partition_size`` h, ranks [k h, (k + 1) h) form node k (a process group each; on one
host, world 4 with h = 2 is two "nodes" of two ranks). When a parameter gathered for the training
passes is released after its forward, each rank keeps ``ceil(numel / h)`` elements of the full value
(piece ``rank % h`` of it, zero-padded): DeepSpeed's ``ds_secondary_tensor``. A parameter the prefetch
coordinator keeps gathered from the forward into the backward needs no copy and gets none. Until those copies are
dropped, gathering the parameter again (the backward pass, a module used twice) is an all-gather of the
h secondary pieces over the node group, which gives back exactly the value the first gather produced:
same bits, so hpZ changes no numerics (with qwZ the secondary holds the dequantized weights, and the
backward sees what the forward saw). The copies are dropped when a forward pass begins, when a piece is
overwritten (GatheredParameters with a modifier, safe_set_*), and after every optimizer step, so a
secondary never outlives the pieces it was cut from. They are counted in ``memory_breakdown()`` under
``hpz_secondary``: ``sum(ceil(numel / h))`` elements per rank at most, between a forward and its step.
Which parameters have a secondary is decided by the same fetches and releases on every rank, so all
ranks pick the same path for a gather.
"""
from typing import Dict, List, Optional, Sequence

import torch

from .. import comm
from . import collectives
from .param import ZeroParam


class SecondaryPartition:
    """The hpZ secondary pieces of one ZeroModel's parameters, and their node group."""

    def __init__(self, size: int, group, node_rank: int):
        self.size, self.group, self.node_rank = size, group, node_rank
        self._pieces: Dict[int, torch.Tensor] = {}  # id(zp) -> its secondary piece
        self._training: Dict[int, ZeroParam] = {}  # gathered for the training passes, not yet released
        self._hooks: Dict[int, object] = {}
        self.gathers = 0  # node-local gathers served (diagnostics, tests)

    def piece_numel(self, zp: ZeroParam) -> int:
        return -(-zp.numel // self.size)

    def holds(self, zp: ZeroParam) -> bool:
        return id(zp) in self._pieces

    def gathered_for_training(self, zps: Sequence[ZeroParam]) -> None:
        """These parameters were gathered from their primary pieces for a forward: their release keeps a
        secondary piece (a backward's gathers leave none: nothing follows them before the step)."""
        for zp in zps:
            self._training[id(zp)] = zp

    def keep(self, zp: ZeroParam) -> None:
        """Called before ``zp`` (AVAILABLE) is partitioned: cut its secondary piece from the full value."""
        if self._training.pop(id(zp), None) is None or id(zp) in self._pieces:
            return
        n = self.piece_numel(zp)
        flat = zp.full.reshape(-1)
        start = self.node_rank * n
        valid = max(0, min(zp.numel, start + n) - start)
        piece = torch.empty(n, dtype=zp.dtype, device=zp.compute_device)
        piece[:valid].copy_(flat[start: start + valid])
        piece[valid:].zero_()
        self._pieces[id(zp)] = piece
        if id(zp) not in self._hooks:  # a piece overwritten invalidates the copy cut from it
            self._hooks[id(zp)] = zp.register_update_hook(self.forget)

    def forget(self, zp: ZeroParam) -> None:
        self._pieces.pop(id(zp), None)
        self._training.pop(id(zp), None)

    def invalidate(self) -> None:
        """Drop every secondary piece (a forward begins, or an optimizer step changed the pieces). Marks
        of gathers already issued stay: a prefetch for the coming forward (issued at the end of the last
        backward, from pieces no step has changed since) still leaves a copy at its release."""
        self._pieces.clear()

    def gather_async(self, bucket: List[ZeroParam], outputs: List[torch.Tensor]) -> collectives.PendingGather:
        """Gather ``bucket`` (every parameter holding a secondary piece) over the node group into
        ``outputs`` (each parameter's padded full storage, world * ceil(numel / world) elements): one
        coalesced all-gather of the pieces straight into the outputs' first h * ceil(numel / h) elements,
        which fit (h divides the world), with no staging copy."""
        self.gathers += 1
        pieces = [self._pieces[id(zp)] for zp in bucket]
        views = [out.view(-1)[: self.size * p.numel()] for out, p in zip(outputs, pieces)]
        work = comm.all_gather_coalesced(views, pieces, group=self.group, async_op=True)
        return collectives.PendingGather(work, None)

    def tensors(self) -> List[torch.Tensor]:
        """The secondary pieces held now (memory accounting)."""
        return list(self._pieces.values())

    def destroy(self) -> None:
        self.invalidate()
        self._training.clear()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()


def node_groups(size: int, world: int, rank: int, new_group) -> Optional[tuple]:
    """(this rank's node group, its rank in it) for hpZ nodes of ``size`` ranks; every rank creates every
    group (torch.distributed requires it). None when hpZ is off (size 1, or the whole world)."""
    if size <= 1 or size >= world:
        return None
    mine = None
    for start in range(0, world, size):
        group = new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine, rank % size
