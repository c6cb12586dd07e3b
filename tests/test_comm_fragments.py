"""One parameter's fragments (zero_ext/comm/fragments.py over csrc/comm_state.c), the state routines'
data path: the C map agrees with the planner's layouts, and the C gather / scatter / local copies give
the bits of a reference built from slices in torch (every rank's partition is reproducible from its
seed), on the native transport and on the torch fallback, with divisors that are not powers of two
(so a reciprocal multiply in place of a division would show), padding and empty fragments."""
import pytest
import torch

from helpers.harness import run_ranks

# (layout, numel, offset, part) for a world of 3: flat parameters inside a buffer of 3 x 10 elements
# (one inside a partition, one straddling all three, one empty, one at the very end); shards with
# padding, with an empty last shard (numel 4 over 3 ranks of 2), and an empty parameter
CASES_3 = [(0, 4, 1, 10), (0, 25, 3, 10), (0, 0, 7, 10), (0, 2, 28, 10),
           (1, 7, 5, 3), (1, 4, 0, 2), (1, 0, 0, 0), (1, 1, 2, 1)]
CASES = {1: [(0, 5, 2, 8), (0, 0, 4, 8), (1, 9, 3, 9), (1, 0, 0, 0)],
         2: [(0, 9, 3, 8), (0, 3, 13, 8), (1, 9, 2, 5), (1, 1, 0, 1), (0, 0, 4, 8)], 3: CASES_3}


def test_the_map_matches_the_planner_and_tiles_the_parameter():
    from zero_ext import _C
    from zero_ext._native import planner

    for world in (1, 2, 3, 4, 7):
        numels = [5, 0, 13, 1, 64, 3]
        padded, offsets = planner.flat_layout(numels, world)
        part = padded // world
        for i, n in enumerate(numels):
            counts, param_at, part_at = _C.frag_map(0, n, offsets[i], part, world)
            for r in range(world):
                piece = {p.param: p for p in planner.flat_fragments(numels, world, r)}.get(i)
                assert counts[r] == (piece.length if piece else 0)
                if piece:
                    assert (param_at[r], part_at[r]) == (piece.param_offset, piece.part_offset)
            assert sum(counts) == n
            assert [a for a, c in zip(param_at, counts) if c] == sorted(a for a, c in zip(param_at, counts) if c)
            shard = planner.shard_numel(n, world)
            counts, param_at, part_at = _C.frag_map(1, n, 11, shard, world)
            assert counts == [planner.shard_valid(n, world, r) for r in range(world)]
            assert part_at == [11] * world and sum(counts) == n


@pytest.mark.parametrize("args", [(2, 5, 0, 3, 2), (0, 5, 8, 3, 2), (1, 9, 0, 2, 3), (0, 1, 0, 0, 2),
                                  (0, 1, 0, 4, 0), (0, -1, 0, 4, 2)])
def test_the_map_refuses_what_does_not_fit(args):
    """An unknown layout, a parameter outside its flat buffer, shards that do not cover it, no
    partition, no ranks, a negative size."""
    from zero_ext import _C

    with pytest.raises(ValueError, match="frag_map"):
        _C.frag_map(*args)


def _partition(rank: int, case_index: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case_index + rank)
    return torch.randn(length, generator=g) * 1e3  # values whose quotients by 3 round


def _reference_full(case, i, world, divisor):
    from zero_ext import _C

    layout, numel, offset, part = case
    counts, _, part_at = _C.frag_map(layout, numel, offset, part, world)
    length = part * world if layout == 0 else offset + part
    pieces = [_partition(r, i, length)[part_at[r]:part_at[r] + counts[r]] for r in range(world)]
    full = torch.cat(pieces) if pieces else torch.zeros(0)
    return full / divisor if divisor != 1.0 else full


def _exercise():
    """Every case: gather (divisors 1 and 3), scatter (factors 1 and 3), local read and write, each
    against the torch reference; the results and the transport."""
    import torch.distributed as dist

    from zero_ext import comm
    from zero_ext.comm.fragments import Fragments

    rank, world = dist.get_rank(), dist.get_world_size()
    cases = CASES[world]
    mismatches = []
    for i, case in enumerate(cases):
        layout, numel, offset, part = case
        length = part * world if layout == 0 else offset + part
        frags = Fragments(layout, numel, offset, part, world, rank)
        mine = _partition(rank, i, length)
        for divisor in (1.0, 3.0):
            got = frags.gather(mine, divisor)
            if not torch.equal(got, _reference_full(case, i, world, divisor)):
                mismatches.append(("gather", case, divisor))
        full = torch.randn(numel, generator=torch.Generator().manual_seed(i)) * 7
        for factor in (1.0, 3.0):
            target = mine.clone()
            frags.scatter(full, target, factor)
            want = mine.clone()
            run = full[frags.param_at[rank]:frags.param_at[rank] + frags.length]
            want[frags.part_at[rank]:frags.part_at[rank] + frags.length] = run * factor
            if not torch.equal(target, want):
                mismatches.append(("scatter", case, factor))
            local = frags.read_local(mine, factor)
            if not torch.equal(local, frags.local(mine) / factor):
                mismatches.append(("read_local", case, factor))
            target = mine.clone()
            value = torch.arange(frags.local_length, dtype=torch.float32) / 7
            frags.write_local(value, target, factor)
            want = mine.clone()
            frags.local(want).copy_(value * factor)
            if not torch.equal(target, want):
                mismatches.append(("write_local", case, factor))
    return comm.transport(), mismatches


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gather_scatter_and_local_copies_give_the_reference_bits(world):
    for env, transport in (({}, "native shared memory"), ({"ZERO_EXT_COMM": "torch"}, "torch.distributed")):
        for got_transport, mismatches in run_ranks(world, _exercise, env=env):
            assert got_transport == transport
            assert mismatches == []


def test_a_value_of_the_wrong_size_is_refused_naming_both_sizes():
    from zero_ext.comm.fragments import Fragments

    frags = Fragments(1, 7, 0, 4, 2, 1)
    with pytest.raises(ValueError, match="the value has 6 elements, the parameter 7"):
        frags.scatter(torch.zeros(6), torch.zeros(4))
    with pytest.raises(ValueError, match="fragment has 4 elements, the value 3"):
        frags.write_local(torch.zeros(3), torch.zeros(4))
