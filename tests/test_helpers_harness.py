"""The multi-rank harness itself: results, a failing rank, a hanging rank, pool reuse."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from helpers.harness import RankFailed, RankTimeout, run_ranks


def _identity():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]), t.item(), torch.get_num_threads()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_rank_returns_its_result(world_size):
    results = run_ranks(world_size, _identity, timeout=60)
    total = world_size * (world_size + 1) / 2
    assert results == [(r, world_size, r, total, 1) for r in range(world_size)]


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken on purpose")
    dist.barrier()  # rank 0 would wait here forever
    return "unreachable"


def test_failing_rank_surfaces_its_traceback_and_the_rest_are_killed():
    start = time.monotonic()
    with pytest.raises(RankFailed) as err:
        run_ranks(2, _fail_on_rank1, timeout=60)
    assert "rank 1 of 2 failed" in str(err.value)
    assert "rank one is broken on purpose" in str(err.value)
    assert "_fail_on_rank1" in str(err.value)  # the traceback, not just the message
    assert time.monotonic() - start < 15
    # the pool recovers: the next case runs on fresh workers
    assert [r[0] for r in run_ranks(2, _identity, timeout=60)] == [0, 1]


def _hang_on_rank0():
    if dist.get_rank() == 0:
        time.sleep(3600)
    return "done"


def test_hanging_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0\] of 2 did not finish within 3s"):
        run_ranks(2, _hang_on_rank0, timeout=3)
    assert time.monotonic() - start < 10
    assert [r[0] for r in run_ranks(2, _identity, timeout=60)] == [0, 1]


def _die():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(3600)


def test_a_rank_that_dies_is_reported_with_its_exit_code():
    with pytest.raises(RankFailed, match="rank 1 died \\(exit code 3\\)"):
        run_ranks(2, _die, timeout=30)


def _pid():
    return os.getpid()


def test_workers_are_reused_between_cases():
    assert run_ranks(2, _pid) == run_ranks(2, _pid)


def _no_group():
    return dist.is_initialized()


def test_init_false_leaves_the_process_group_to_the_case():
    assert run_ranks(2, _no_group, init=False) == [False, False]
