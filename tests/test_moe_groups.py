"""Expert-parallel groups (zero_ext/moe/groups.py) on 4 gloo ranks: the layouts of docs/moe.md for ep_size
1, 2 and 4 (and "data before expert"), checked by the rank lists and by a sum over each real group; the
lookups, the errors, and the rank arithmetic of the tensor-parallel layout (no ranks needed)."""
import pytest
import torch

from helpers.harness import run_ranks


def _layouts():
    from zero_ext import comm
    from zero_ext.moe import groups

    rank = comm.get_rank()
    seen = {}
    for ep in (1, 2, 4):
        name = groups.create_expert_and_data_parallel(ep)
        assert name == f"ep_size_{ep}" and groups.create_expert_and_data_parallel(ep) == name  # idempotent
        total = torch.tensor([float(rank)])
        comm.all_reduce(total, group=groups.expert_parallel_group(name))  # the group object is the right one
        edp_total = torch.tensor([float(rank)])
        comm.all_reduce(edp_total, group=groups.expert_data_parallel_group(name))
        seen[ep] = (groups.expert_parallel_group_ranks(name), groups.expert_data_parallel_group_ranks(name),
                    groups.expert_parallel_rank(name), groups.expert_parallel_world_size(name),
                    groups.expert_data_parallel_rank(name), groups.expert_data_parallel_world_size(name),
                    groups.expert_broadcast_src_rank(name), total.item(), edp_total.item())
    names = groups.expert_group_names()
    assert set(groups.expert_parallel_groups()) == set(groups.expert_data_parallel_groups()) == set(names)
    try:
        groups.expert_parallel_group("ep_size_8")
    except KeyError as e:
        missing = str(e)
    try:
        groups.create_expert_and_data_parallel(3)
    except ValueError as e:
        indivisible = str(e)
    return seen, names, missing, indivisible


def _data_before_expert():
    from zero_ext import comm
    from zero_ext.moe import groups

    name = groups.create_expert_and_data_parallel(2, use_data_before_expert_parallel=True)
    total = torch.tensor([float(comm.get_rank())])
    comm.all_reduce(total, group=groups.expert_parallel_group(name))
    return groups.expert_parallel_group_ranks(name), groups.expert_data_parallel_group_ranks(name), total.item()


def test_layouts_on_four_ranks():
    results = run_ranks(4, _layouts, timeout=60)
    for rank, (seen, names, missing, indivisible) in enumerate(results):
        assert names == ["ep_size_1", "ep_size_2", "ep_size_4"]
        # ep 1: each rank alone holds every expert; the experts' data-parallel group is the world
        assert seen[1] == ([rank], [0, 1, 2, 3], 0, 1, rank, 4, 0, rank, 6.0)
        # ep 2: EP groups consecutive {0,1} {2,3}; EDP groups strided {0,2} {1,3}
        ep = [rank - rank % 2, rank - rank % 2 + 1]
        edp = [rank % 2, rank % 2 + 2]
        assert seen[2] == (ep, edp, rank % 2, 2, rank // 2, 2, rank % 2, float(sum(ep)), float(sum(edp)))
        # ep 4: one EP group of all; each rank its own EDP group
        assert seen[4] == ([0, 1, 2, 3], [rank], rank, 4, 0, 1, rank, 6.0, float(rank))
        assert "ep_size_8" in missing and "ep_size_1, ep_size_2, ep_size_4" in missing
        assert "ep_size 3" in indivisible and "4 ranks" in indivisible


def test_data_before_expert_layout():
    results = run_ranks(4, _data_before_expert, timeout=60)
    for rank, (ep, edp, total) in enumerate(results):
        assert ep == [rank % 2, rank % 2 + 2]  # D + E: EP strided by world / ep
        assert edp == [rank - rank % 2, rank - rank % 2 + 1]  # EDP consecutive
        assert total == float(sum(ep))


def test_rank_arithmetic():
    from zero_ext.moe.groups import expert_and_data_parallel_ranks, expert_parallel_ranks

    assert expert_and_data_parallel_ranks(8, 2) == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert expert_and_data_parallel_ranks(8, 2, True) == ([[0, 4], [1, 5], [2, 6], [3, 7]],
                                                          [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert expert_and_data_parallel_ranks(8, 2, pp_size=2) == ([[0, 1], [2, 3], [4, 5], [6, 7]],
                                                               [[0, 2], [1, 3], [4, 6], [5, 7]])
    # E + M + D on 16 ranks, tensor-parallel 2, ep 4 (DeepSpeed's documented example)
    ep, edp = expert_parallel_ranks(16, 2, 4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    with pytest.raises(ValueError, match="ep_size 3 does not divide the world of 8"):
        expert_and_data_parallel_ranks(8, 3)


def test_one_process_world():
    from zero_ext.moe import groups

    assert groups.create_expert_and_data_parallel(1) == "ep_size_1"
    assert groups.expert_parallel_group("ep_size_1") is None  # None: the one-rank world
    assert groups.expert_parallel_world_size("ep_size_1") == 1 and groups.expert_broadcast_src_rank("ep_size_1") == 0
    with pytest.raises(ValueError, match="ep_size 2 needs 2 ranks"):
        groups.create_expert_and_data_parallel(2)
