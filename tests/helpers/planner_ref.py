"""A small pure-Python reference of the partition planner (csrc/planner.c), written from the layout
rules in docs/design.md rather than from the C code: slow, obvious, and only for tests."""
from math import ceil


def flat_layout(numels, world, align):
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    unit = align * world
    return ceil(total / unit) * unit, offsets


def flat_fragments(numels, world, align, rank):
    padded, offsets = flat_layout(numels, world, align)
    part = padded // world
    lo, hi = rank * part, (rank + 1) * part
    out = []
    for i, (n, off) in enumerate(zip(numels, offsets)):
        a, b = max(off, lo), min(off + n, hi)
        if a < b:
            out.append((i, rank, a - off, a - lo, -1, b - a))
    return out


def flat_bucket_pieces(numels, world, align, order):
    padded, offsets = flat_layout(numels, world, align)
    part = padded // world
    out, pos = [], 0
    for i in order:
        for r in range(world):  # intersect the parameter with every partition
            lo, hi = r * part, (r + 1) * part
            a, b = max(offsets[i], lo), min(offsets[i] + numels[i], hi)
            if a < b:
                out.append((i, r, a - offsets[i], a - lo, pos + a - offsets[i], b - a))
        pos += numels[i]
    return out


def allgather_chunk(partition, world, align, bucket):
    return max(align, (bucket // world) // align * align)


def shard_numel(numel, world):
    return -(-numel // world)


def shard_valid(numel, world, rank):
    shard = shard_numel(numel, world)
    return len(range(rank * shard, min((rank + 1) * shard, numel)))


def sub_groups(numels, world, sub_group_size):
    groups, current, held = [], 0, 0
    for k, n in enumerate(numels):
        groups.append(current)
        held += shard_numel(n, world)
        if held >= sub_group_size and k < len(numels) - 1:
            current, held = current + 1, 0
    return groups


def shard_bucket_pieces(numels, world, order):
    block = sum(shard_numel(numels[i], world) for i in order)
    out = []
    for r in range(world):
        pos = r * block
        for i in order:
            shard = shard_numel(numels[i], world)
            valid = shard_valid(numels[i], world, r)
            if valid:
                out.append((i, r, r * shard, 0, pos, valid))
            pos += shard
    return block, out


def buckets(sizes, bucket_size, order=None):
    order = list(range(len(sizes))) if order is None else order
    result, current, held = [], 0, 0
    for k, i in enumerate(order):
        if k > 0 and held > 0 and held + sizes[i] > bucket_size:
            current, held = current + 1, 0
        result.append(current)
        held += sizes[i]
    return result
