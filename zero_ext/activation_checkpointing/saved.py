"""What ``checkpoint()`` keeps of a checkpointed call's inputs until backward recomputes the call:
this rank's partition of each input (``partition_activations``), in host memory (``cpu_checkpointing``),
in preallocated buffers (``contiguous_memory_optimization``); and what backward makes of it again.

``pack`` and ``unpack`` are saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) around
torch's reentrant checkpoint, which saves exactly the call's tensor inputs: what they return is what
autograd holds instead of the input, so the input itself is freed as soon as nothing else refers to it.
"""
import math
import weakref
from typing import Iterator, List, Optional, Tuple

import torch

from .. import comm


class Kept:
    """One saved input as kept: ``part`` (this rank's equal, zero-padded share of the flattened input,
    or all of it) and what is needed to make the input again."""

    __slots__ = ("part", "shape", "dtype", "device", "numel", "group", "size", "host", "in_buffer", "__weakref__")

    def __init__(self, part, source: torch.Tensor, group, size: int, host: bool, in_buffer: bool):
        self.part, self.shape, self.dtype, self.device = part, source.shape, source.dtype, source.device
        self.numel, self.group, self.size, self.host, self.in_buffer = source.numel(), group, size, host, in_buffer


_live: "weakref.WeakSet[Kept]" = weakref.WeakSet()  # every Kept autograd still holds (memory accounting)


class ContiguousBuffers:
    """``contiguous_memory_optimization``: per input position (the i-th checkpointed tensor of a call),
    one buffer of ``number_checkpoints`` equal slots that the partitions of successive calls fill in
    order. Backward (or ``reset()``) drops the buffers; kept partitions hold theirs until used."""

    def __init__(self):
        self.buffers: List[torch.Tensor] = []
        self.used: List[int] = []

    def slot(self, position: int, numel: int, dtype, device, slots: int) -> torch.Tensor:
        if position == len(self.buffers):
            self.buffers.append(torch.empty(slots, numel, dtype=dtype, device=device))
            self.used.append(0)
        buf = self.buffers[position]
        if buf.shape[1] != numel or buf.dtype != dtype or buf.device != device:
            raise ValueError(f"contiguous_memory_optimization: checkpointed input {position} has a partition of "
                             f"{numel} {dtype} elements on {device}, but this forward's earlier calls had "
                             f"{buf.shape[1]} {buf.dtype} on {buf.device}; the buffers need calls of one shape "
                             "(homogeneous layers): turn contiguous_memory_optimization off for this model")
        if self.used[position] == slots:
            raise ValueError(f"contiguous_memory_optimization: more than number_checkpoints={slots} checkpointed "
                             "calls before a backward; raise number_checkpoints to the calls per forward, or call "
                             "deepspeed.checkpointing.reset() after a forward that has no backward (evaluation)")
        self.used[position] += 1
        return buf[self.used[position] - 1]

    def drop(self) -> None:
        self.buffers, self.used = [], []

    def tensors(self) -> List[torch.Tensor]:
        return list(self.buffers)


buffers = ContiguousBuffers()


def wanted(t: torch.Tensor, size: int) -> bool:
    """DeepSpeed's rule for which inputs are checkpointed as activations: floating point, at least one
    element per rank, and not marked ``no_checkpointing``."""
    return t.is_floating_point() and t.numel() >= max(size, 1) and not getattr(t, "no_checkpointing", False)


def packer(settings):
    """The pack hook of one checkpoint() call (it numbers the call's inputs for the contiguous buffers)."""
    group, size, rank = settings.partition_group
    position = [0]

    def pack(t: torch.Tensor):
        if not wanted(t, size) or (size == 1 and not settings.cpu_checkpointing
                                   and not settings.contiguous_memory_optimization):
            return t
        flat = t.detach().reshape(-1)
        share = math.ceil(flat.numel() / size)
        piece = flat[rank * share:(rank + 1) * share]  # the last ranks' may be short (or empty)
        device = torch.device("cpu") if settings.cpu_checkpointing else t.device
        if settings.contiguous_memory_optimization:
            part = buffers.slot(position[0], share, t.dtype, device, settings.number_checkpoints)
        elif size > 1 or piece.numel() < share:
            part = torch.empty(share, dtype=t.dtype, device=device)
        else:
            part = piece.to(device)  # a host copy (the input itself where it already is in host memory)
        if part.data_ptr() != piece.data_ptr():
            part[:piece.numel()].copy_(piece)
            part[piece.numel():].zero_()
        position[0] += 1
        kept = Kept(part, t, group, size, settings.cpu_checkpointing, settings.contiguous_memory_optimization)
        _live.add(kept)
        return kept

    return pack


def unpack(kept):
    """The input again, on its device: this rank's part all-gathered over the partition group (the one
    collective of recomputation), or the host copy moved back."""
    if not isinstance(kept, Kept):
        return kept
    part = kept.part.to(kept.device)
    if kept.size > 1:
        full = torch.empty(kept.size * part.numel(), dtype=kept.dtype, device=kept.device)
        comm.all_gather_into(full, part.contiguous(), group=kept.group)
    elif kept.in_buffer and part.data_ptr() == kept.part.data_ptr():
        full = part.clone()  # a slot of a contiguous buffer: the input must not alias the buffer
    else:
        full = part
    return full[:kept.numel].view(kept.shape)


def held() -> Iterator[Tuple[torch.Tensor, Optional[str]]]:
    """(tensor, tier) of every partition, host copy and contiguous buffer held now; tier ``"host"`` for
    cpu_checkpointing's copies, None for the tensor's own device."""
    for kept in list(_live):
        yield kept.part, ("host" if kept.host else None)
    for buf in buffers.tensors():
        yield buf, ("host" if buf.device.type == "cpu" else None)


def held_bytes() -> int:
    """Bytes of what checkpoint() keeps now, each storage byte once (a partition in a buffer is not
    counted twice)."""
    seen = {}
    for t, _ in held():
        base = t if t._base is None else t._base
        seen[(str(base.device), base.untyped_storage().data_ptr())] = base.untyped_storage().nbytes()
    return sum(seen.values())
