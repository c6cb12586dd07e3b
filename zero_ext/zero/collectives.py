"""The ZeRO-3 parameter collectives, as free functions over tensors with an explicit process group.

They hold no state and know nothing of modules or ZeroParams, so the communication schedule can be
read from the callers (fetch.py, convert.py, gathered.py) alone. Layouts come from the planner
(zero_ext._native.planner, see docs/design.md "Layouts"), never recomputed here.

[Note: coalesced all-gather]
Gathering the parameters of one module is one collective. Each rank lays its pieces out in one block,
in the order given, each piece padded to its shard size (``planner.shard_bucket_pieces``: the blocks
are then equal in length); ``all_gather_into_tensor`` fills a rank-major buffer of ``world`` blocks, and
each parameter's full value is copied out of it (a strided copy of ``world`` runs) into the parameter's
own storage. The rank's own block is a view into the output buffer, so the input needs no extra copy
(an in-place all-gather). A single parameter needs no copy-out: its padded storage is already the
rank-major layout of one piece per rank, so the all-gather writes straight into it. Where the backend
lacks ``all_gather_into_tensor`` (gloo in old torch versions), the list form of ``all_gather`` fills
the same buffer through per-rank views.
``all_gather_pieces_async`` issues the same collective with ``async_op=True`` and returns a
PendingGather whose ``wait()`` finishes it (the copy-out included): the prefetch coordinator issues
gathers for modules that have not run yet and waits when they do.
"""
import hashlib
import struct
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import comm
from .._native import planner
from .quantized_gather import all_gather_quantized_async

def rank_and_world(group) -> Tuple[int, int]:
    """This process's rank in ``group`` and the group's size (0 and 1 without torch.distributed)."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` within ``group`` (None: the default group)."""
    if group is None or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


class PendingGather:
    """An all-gather issued by ``all_gather_pieces_async``. ``wait()`` blocks until it is complete and
    the parameters' storages hold their full values (on CUDA: until the current stream is ordered
    after it); later calls return at once."""

    __slots__ = ("_work", "_finish")

    def __init__(self, work, finish: Optional[Callable[[], None]]):
        self._work, self._finish = work, finish

    def wait(self) -> None:
        work, finish = self._work, self._finish
        self._work = self._finish = None
        if work is not None:
            work.wait()
        if finish is not None:
            finish()


def all_gather_pieces(pieces: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                      numels: Sequence[int], group) -> None:
    """Gathers several parameters in one collective (see [Note: coalesced all-gather]).

    pieces[i]:  this rank's piece of parameter i, (shard_numel(numels[i], world),), any device
    outputs[i]: parameter i's padded full storage, (world * shard_numel,), on the compute device;
                filled with every rank's piece in rank order
    """
    all_gather_pieces_async(pieces, outputs, numels, group).wait()


def all_gather_pieces_async(pieces: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                            numels: Sequence[int], group, quantized: bool = False,
                            by_all_reduce: bool = False) -> PendingGather:
    """``all_gather_pieces``, issued with ``async_op=True``: the outputs may be read only after the
    returned gather's ``wait()``. Every rank must issue the same gathers in the same order (gloo and
    NCCL match collectives by issue order), however many are outstanding. ``quantized``: ZeRO++ qwZ,
    the pieces travel as int8 and every rank gets their dequantized values (see [Note: quantized
    all-gather] in quantized_gather.py; one rank has nothing to send and copies exactly).
    ``by_all_reduce`` (``stage3_use_all_reduce_for_fetch_params``): the same buffer, zero-filled, summed
    over the ranks by an all-reduce: every other rank adds zeros to a rank's block, so the values are the
    all-gather's (a -0.0 comes back +0.0, as with DeepSpeed's), for twice the traffic."""
    rank, world = rank_and_world(group)
    if world == 1:
        for piece, out in zip(pieces, outputs):
            out.copy_(piece)
        return PendingGather(None, None)
    if quantized:
        return all_gather_quantized_async(pieces, outputs, group, rank, world, PendingGather)
    if len(pieces) == 1 and not by_all_reduce:
        out = outputs[0]
        own = out.view(world, -1)[rank]
        own.copy_(pieces[0])
        return PendingGather(comm.all_gather_into(out, own, group, async_op=True), None)
    block, layout = planner.shard_bucket_pieces(numels, world, range(len(numels)))
    offsets = {p.param: p.bucket_offset for p in layout if p.rank == 0}  # each piece's start in a block
    make = torch.zeros if by_all_reduce else torch.empty
    buffer = make(world * block, dtype=outputs[0].dtype, device=outputs[0].device)
    blocks = buffer.view(world, block)
    own = blocks[rank]
    for i, piece in enumerate(pieces):
        if i in offsets:
            own[offsets[i]: offsets[i] + piece.numel()].copy_(piece)
    if by_all_reduce:
        work = comm.all_reduce(buffer, group=group, async_op=True)
    else:
        work = comm.all_gather_into(buffer, own, group, async_op=True)

    def copy_out():  # after the wait: on CUDA, on the current stream, which now follows the collective
        for i, out in enumerate(outputs):
            if i in offsets:
                size = out.numel() // world
                out.view(world, size).copy_(blocks[:, offsets[i]: offsets[i] + size])
    return PendingGather(work, copy_out)


def all_gather_two_level_async(pieces: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                               numels: Sequence[int], intra, inter, per_node: int) -> PendingGather:
    """``all_gather_pieces_async`` over a partition group of n nodes of ``per_node`` ranks (group rank
    j * per_node + i is rank i of node j), in two levels (MiCS's hierarchical gather, zero/mics.py): an
    all-gather over ``inter`` (rank i of every node: each piece crosses to each other node once), then one
    over ``intra`` (the node) of what that brought. The same blocks land in the same places as in the flat
    gather, so the outputs hold the same bits. The first level is synchronous, the second is returned."""
    i, g = rank_and_world(intra)
    j, n = rank_and_world(inter)
    assert g == per_node, (g, per_node)
    world = n * g
    block, layout = planner.shard_bucket_pieces(numels, world, range(len(numels)))
    offsets = {p.param: p.bucket_offset for p in layout if p.rank == 0}
    dtype, device = outputs[0].dtype, outputs[0].device
    across = torch.empty(n * block, dtype=dtype, device=device)  # [node j] -> block of rank j * g + i
    own = across.view(n, block)[j]
    own.zero_()
    for k, piece in enumerate(pieces):
        if k in offsets:
            own[offsets[k]: offsets[k] + piece.numel()].copy_(piece)
    comm.all_gather_into(across, own, inter)
    both = torch.empty(g * n * block, dtype=dtype, device=device)  # [i'][j] -> block of rank j * g + i'
    work = comm.all_gather_into(both, across, intra, async_op=True)

    def copy_out():
        by_rank = both.view(g, n, block).transpose(0, 1)  # [j][i']: rank-major
        for k, out in enumerate(outputs):
            if k in offsets:
                size = out.numel() // world
                out.view(n, g, size).copy_(by_rank[:, :, offsets[k]: offsets[k] + size])
    return PendingGather(work, copy_out)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group) -> None:
    """``tensor`` (contiguous) takes the value it has on group rank ``src_group_rank``."""
    if rank_and_world(group)[1] > 1:
        comm.broadcast(tensor, src=global_rank(group, src_group_rank), group=group)


def scatter_pieces(full: torch.Tensor, piece: torch.Tensor, src_group_rank: int, group) -> None:
    """``piece`` (shard_numel elements) becomes this rank's piece of ``full`` as it is on
    ``src_group_rank``, padding zeroed. ``full`` is read on the source rank only (every rank passes its
    own: under zero.Init each rank has built the whole parameter)."""
    rank, world = rank_and_world(group)
    shard = piece.numel()
    flat = full.reshape(-1)
    if world == 1:
        piece[: flat.numel()].copy_(flat)
        piece[flat.numel():].zero_()
        return
    chunks: Optional[List[torch.Tensor]] = None
    if rank == src_group_rank:
        if flat.numel() == world * shard and flat.is_contiguous():
            padded = flat
        else:
            padded = torch.zeros(world * shard, dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()].copy_(flat)
        chunks = list(padded.view(world, shard).unbind(0))
    comm.scatter(piece, chunks, src=global_rank(group, src_group_rank), group=group)


def agree(row: Sequence[int], group, device: torch.device) -> List[List[int]]:
    """Every rank's ``row`` (the same number of int64 values on each rank), rank by rank: one small
    all-gather of fixed size, safe to run even when the ranks are about to disagree."""
    rank, world = rank_and_world(group)
    if world == 1:
        return [list(row)]
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    out = torch.empty(world * len(row), dtype=torch.int64, device=device)
    comm.all_gather_into(out, mine, group)
    return out.view(world, len(row)).tolist()


def check_device(group, compute_device: torch.device) -> torch.device:
    """Where small control tensors (agreement rows) go for ``group``: host memory when the group has
    a gloo backend (no device synchronisation), else the compute device."""
    if compute_device.type == "cpu":
        return compute_device
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        backend = ""
    return torch.device("cpu") if "gloo" in backend else compute_device


def digest(values: Sequence[int]) -> int:
    """A 62-bit digest of a sequence of ints, identical in every process (unlike ``hash`` of strings)."""
    h = hashlib.blake2b(struct.pack(f"<{len(values)}q", *values), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2
