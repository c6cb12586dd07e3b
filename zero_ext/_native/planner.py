"""Where every element of a ZeRO model lives: the layouts computed by the C planner (csrc/planner.c).

Stage 1/2 lay each param group out flat and cut it into equal partitions; stage 3 cuts each parameter
into ``world`` shards of ``ceil(numel / world)``. Both match DeepSpeed's layouts, so checkpoints keep
DeepSpeed's shapes (see docs/design.md, "Layouts"). All sizes are element counts.
"""
from typing import List, NamedTuple, Optional, Sequence, Tuple

from .. import _C

# DeepSpeed pads stage 1/2 flat buffers to a multiple of 2 * world (nccl_start_alignment_factor): with
# 2-byte elements every partition then starts on a 4-byte boundary, as NCCL wants.
NCCL_START_ALIGNMENT_FACTOR = 2


class Piece(NamedTuple):
    """A contiguous run of one parameter's elements owned by one rank."""

    param: int  # index of the parameter in the list given
    rank: int  # owning rank
    param_offset: int  # first element within the flattened parameter
    part_offset: int  # first element within the owner's partition (stage 1/2) or shard (stage 3)
    bucket_offset: int  # first element within the bucket buffer; -1 outside bucket plans
    length: int


def _pieces(rows) -> List[Piece]:
    return [Piece(*row) for row in rows]


def flat_layout(numels: Sequence[int], world: int, align: int = NCCL_START_ALIGNMENT_FACTOR) -> Tuple[int, List[int]]:
    """Stage 1/2: (padded length of the group's flat buffer, start offset of each parameter)."""
    return _C.flat_layout(list(numels), world, align)


def flat_fragments(numels: Sequence[int], world: int, rank: int, align: int = NCCL_START_ALIGNMENT_FACTOR) -> List[Piece]:
    """Stage 1/2: the pieces of every parameter inside ``rank``'s partition, in flat order."""
    return _pieces(_C.flat_fragments(list(numels), world, align, rank))


def flat_bucket_pieces(numels: Sequence[int], world: int, order: Sequence[int],
                       align: int = NCCL_START_ALIGNMENT_FACTOR) -> List[Piece]:
    """Stage 1/2: owners of each run of a bucket that holds parameters ``order`` back to back."""
    return _pieces(_C.flat_bucket_pieces(list(numels), world, align, list(order)))


def allgather_chunk(partition: int, world: int, bucket: int, align: int = NCCL_START_ALIGNMENT_FACTOR) -> int:
    """Stage 1/2: elements of each partition gathered per all-gather call under ``bucket`` elements."""
    return _C.allgather_chunk(partition, world, align, bucket)


def shard_numel(numel: int, world: int) -> int:
    """Stage 3: elements in each shard of a parameter, ``ceil(numel / world)``."""
    return _C.shard_numel(numel, world)


def shard_valid(numel: int, world: int, rank: int) -> int:
    """Stage 3: real (unpadded) elements in ``rank``'s shard."""
    return _C.shard_valid(numel, world, rank)


def sub_groups(numels: Sequence[int], world: int, sub_group_size: int) -> List[int]:
    """Stage 3: the optimizer sub-group of each parameter (whole parameters, DeepSpeed's boundaries)."""
    return _C.sub_groups(list(numels), world, sub_group_size)


def shard_bucket_pieces(numels: Sequence[int], world: int, order: Sequence[int]) -> Tuple[int, List[Piece]]:
    """Stage 3: (block length, pieces) of a rank-major bucket, as reduce_scatter_tensor lays it out."""
    block, rows = _C.shard_bucket_pieces(list(numels), world, list(order))
    return block, _pieces(rows)


def buckets(sizes: Sequence[int], bucket_size: int, order: Optional[Sequence[int]] = None) -> List[int]:
    """The bucket of each item, taken in ``order``: consecutive, at most ``bucket_size`` elements each,
    an item larger than a bucket alone in its own."""
    return _C.buckets(list(sizes), bucket_size, None if order is None else list(order))
