"""The C partition planner against the pure-Python reference, plus the invariants every layout keeps."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import planner_ref as ref
from zero_ext._native import planner

settings.register_profile("zero_ext", max_examples=300, deadline=None)
settings.load_profile("zero_ext")

numel_lists = st.lists(st.one_of(st.integers(0, 40), st.just(0), st.integers(0, 3)), max_size=12)
worlds = st.integers(1, 9)
aligns = st.sampled_from([1, 2, 4])


@given(numel_lists, worlds, aligns)
def test_flat_layout_and_fragments_match_reference(numels, world, align):
    padded, offsets = planner.flat_layout(numels, world, align)
    assert (padded, offsets) == ref.flat_layout(numels, world, align)
    assert padded % (align * world) == 0 and padded - sum(numels) < align * world
    part = padded // world
    owner = {}  # (param, element) -> (rank, place in partition): every element exactly once
    for rank in range(world):
        pieces = planner.flat_fragments(numels, world, rank, align)
        assert [tuple(p) for p in pieces] == ref.flat_fragments(numels, world, align, rank)
        for p in pieces:
            assert p.length > 0 and p.part_offset + p.length <= part
            for e in range(p.length):
                key = (p.param, p.param_offset + e)
                assert key not in owner
                owner[key] = (rank, p.part_offset + e)
                assert offsets[p.param] + p.param_offset + e == rank * part + p.part_offset + e
    assert len(owner) == sum(numels)


@given(numel_lists, worlds, aligns, st.data())
def test_flat_bucket_pieces_match_reference(numels, world, align, data):
    order = data.draw(st.permutations(range(len(numels))))
    order = order[: data.draw(st.integers(0, len(order)))]
    pieces = planner.flat_bucket_pieces(numels, world, order, align)
    assert [tuple(p) for p in pieces] == ref.flat_bucket_pieces(numels, world, align, order)
    # the pieces tile the bucket buffer exactly, in order
    pos = 0
    for p in pieces:
        assert p.bucket_offset == pos
        pos += p.length
    assert pos == sum(numels[i] for i in order)


@given(numel_lists, worlds)
def test_shard_sizes_and_padding(numels, world):
    for n in numels:
        shard = planner.shard_numel(n, world)
        assert shard == ref.shard_numel(n, world)
        valid = [planner.shard_valid(n, world, r) for r in range(world)]
        assert valid == [ref.shard_valid(n, world, r) for r in range(world)]
        assert sum(valid) == n and shard * world - n < world


@given(numel_lists, worlds, st.data())
def test_shard_bucket_pieces_match_reference(numels, world, data):
    order = data.draw(st.permutations(range(len(numels))))
    block, pieces = planner.shard_bucket_pieces(numels, world, order)
    assert (block, [tuple(p) for p in pieces]) == ref.shard_bucket_pieces(numels, world, order)
    # each rank's block holds its own shards; together the pieces cover every element once
    for p in pieces:
        assert p.rank * block <= p.bucket_offset < (p.rank + 1) * block
    assert sum(p.length for p in pieces) == sum(numels)


@given(numel_lists, worlds, st.integers(0, 60))
def test_sub_groups_match_reference(numels, world, size):
    groups = planner.sub_groups(numels, world, size)
    assert groups == ref.sub_groups(numels, world, size)
    # whole parameters, consecutive groups, each closed only once it reached the size
    assert groups == sorted(groups) and (not groups or groups[0] == 0)
    for g in set(groups[:-1]) - {groups[-1] if groups else None}:
        assert sum(planner.shard_numel(n, world) for n, k in zip(numels, groups) if k == g) >= size


@given(st.lists(st.integers(0, 50), max_size=15), st.integers(0, 60), st.data())
def test_buckets_match_reference(sizes, bucket_size, data):
    order = data.draw(st.one_of(st.none(), st.permutations(range(len(sizes)))))
    got = planner.buckets(sizes, bucket_size, order)
    assert got == ref.buckets(sizes, bucket_size, order)
    items = list(range(len(sizes))) if order is None else list(order)
    for b in set(got):  # a bucket over the size holds exactly one item
        members = [sizes[i] for i, k in zip(items, got) if k == b]
        assert sum(members) <= bucket_size or len([m for m in members if m]) == 1


@given(st.integers(0, 10**6), worlds, aligns, st.integers(0, 10**6))
def test_allgather_chunk(partition, world, align, bucket):
    chunk = planner.allgather_chunk(partition, world, bucket, align)
    assert chunk == ref.allgather_chunk(partition, world, align, bucket)
    assert chunk % align == 0 and (chunk * world <= bucket or chunk == align)


def test_world_size_one_is_one_partition_of_everything():
    numels = [7, 0, 3]
    assert planner.flat_layout(numels, 1, 2) == (10, [0, 7, 7])
    assert [tuple(p) for p in planner.flat_fragments(numels, 1, 0, 2)] == [(0, 0, 0, 0, -1, 7), (2, 0, 0, 7, -1, 3)]
    assert planner.shard_numel(7, 1) == 7 and planner.shard_valid(7, 1, 0) == 7


def test_more_ranks_than_elements():
    # 3 elements over 8 ranks: stage 1/2 pads to 16 (2 per rank); stage 3 gives ranks 3..7 pure padding
    padded, _ = planner.flat_layout([3], 8, 2)
    assert padded == 16
    assert [len(planner.flat_fragments([3], 8, r, 2)) for r in range(8)] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert [planner.shard_valid(3, 8, r) for r in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]


def test_one_huge_parameter():
    n = 3 * 10**12 + 7  # far past 2^32: offsets must stay 64-bit
    world = 4
    padded, offsets = planner.flat_layout([n], world, 2)
    assert padded == ref.flat_layout([n], world, 2)[0]
    pieces = [planner.flat_fragments([n], world, r, 2) for r in range(world)]
    assert sum(p[0].length for p in pieces) == n
    assert planner.shard_numel(n, world) == -(-n // world)
    assert planner.sub_groups([n, 5], world, 10**9) == [0, 1]


def test_zero_size_parameters_own_nothing():
    assert planner.flat_fragments([0, 0], 2, 0) == []
    assert planner.flat_layout([0, 0], 2) == (0, [0, 0])
    assert planner.shard_bucket_pieces([0], 3, [0]) == (0, [])


@pytest.mark.parametrize("call", [
    lambda: planner.flat_layout([1, -1], 2),
    lambda: planner.flat_layout([1], 0),
    lambda: planner.flat_fragments([1], 2, 2),
    lambda: planner.flat_bucket_pieces([1], 2, [1]),
    lambda: planner.shard_numel(-1, 2),
    lambda: planner.shard_valid(4, 2, 5),
    lambda: planner.sub_groups([1], 1, -1),
    lambda: planner.buckets([1, 2], -1),
])
def test_bad_arguments_raise_value_error(call):
    with pytest.raises(ValueError, match="invalid argument"):
        call()


def test_overflow_is_reported():
    with pytest.raises(OverflowError):
        planner.flat_layout([2**62, 2**62], 2)


def test_non_int_elements_are_type_errors():
    with pytest.raises(TypeError, match=r"numels\[1\] must be an int"):
        planner.flat_layout([1, "x"], 2)
