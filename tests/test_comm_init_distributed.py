"""zero_ext.init_distributed: env:// from torchrun's variables, single process, timeouts, MPI, no-op."""
import datetime
import os

import pytest
import torch.distributed as dist

import zero_ext
from helpers.harness import run_ranks
from zero_ext import comm

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "DEEPSPEED_TIMEOUT")


def _group_timeout():
    # the timeout the default group was created with (private, but the only place torch keeps it)
    import torch
    from torch.distributed.distributed_c10d import _get_default_group

    group = _get_default_group()
    backend = group._get_backend(torch.device("cpu")) if hasattr(group, "_get_backend") else group
    return getattr(getattr(backend, "options", None), "_timeout", None)


def _init_from_torchrun_variables():
    zero_ext.init_distributed(verbose=False)
    zero_ext.init_distributed(verbose=False)  # second call: a no-op, not an error
    return dist.get_rank(), dist.get_world_size(), dist.get_backend(), comm.get_local_rank()


@pytest.mark.parametrize("world_size", [2, 4])
def test_env_initialisation_from_torchrun_variables(world_size):
    results = run_ranks(world_size, _init_from_torchrun_variables, init=False, timeout=60)
    assert results == [(r, world_size, "gloo", r) for r in range(world_size)]


def _explicit_rank_and_world_size():
    rank, world = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
    zero_ext.init_distributed(rank=rank, world_size=world, verbose=False)
    return dist.get_rank(), dist.get_world_size()


def test_explicit_rank_and_world_size():
    assert run_ranks(2, _explicit_rank_and_world_size, init=False) == [(0, 2), (1, 2)]


def _mpi_discovery():
    env = os.environ
    env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"] = env.pop("RANK"), env.pop("WORLD_SIZE")
    env["OMPI_COMM_WORLD_LOCAL_RANK"] = env.pop("LOCAL_RANK")
    zero_ext.init_distributed(verbose=False)
    out = dist.get_rank(), dist.get_world_size(), comm.get_local_rank()
    for k in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"):
        del env[k]
    return out


def test_mpi_variables_are_discovered():
    assert run_ranks(2, _mpi_discovery, init=False) == [(0, 2, 0), (1, 2, 1)]


def _single_process(timeout_env):
    for k in LAUNCH_VARS:
        os.environ.pop(k, None)
    if timeout_env:
        os.environ["DEEPSPEED_TIMEOUT"] = timeout_env
    zero_ext.init_distributed(verbose=False)
    out = dist.get_rank(), dist.get_world_size(), dist.get_backend(), _group_timeout()
    os.environ.pop("DEEPSPEED_TIMEOUT", None)
    return out


def test_no_launcher_gives_a_single_process_group_with_the_default_timeout():
    (rank, world, backend, timeout), = run_ranks(1, _single_process, None, init=False)
    assert (rank, world, backend) == (0, 1, "gloo")
    if timeout is not None:
        assert timeout == datetime.timedelta(minutes=10)


def test_deepspeed_timeout_sets_the_collective_timeout():
    (_, _, _, timeout), = run_ranks(1, _single_process, "3", init=False)
    if timeout is None:
        pytest.skip("this torch does not expose the process group's timeout")
    assert timeout == datetime.timedelta(minutes=3)


def test_default_timeout_reads_deepspeed_timeout(monkeypatch):
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    assert comm.default_timeout() == datetime.timedelta(minutes=10)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "2.5")
    assert comm.default_timeout() == datetime.timedelta(minutes=2.5)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "ten")
    with pytest.raises(ValueError, match="DEEPSPEED_TIMEOUT='ten' is not a number of minutes"):
        comm.default_timeout()


def test_backend_is_gloo_without_cuda():
    assert comm.default_backend() == "gloo"


def _mpi_without_master_addr():
    for k in LAUNCH_VARS:
        os.environ.pop(k, None)
    os.environ.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2")
    try:
        zero_ext.init_distributed(verbose=False)
    finally:
        del os.environ["OMPI_COMM_WORLD_RANK"], os.environ["OMPI_COMM_WORLD_SIZE"]


def test_mpi_launch_without_master_addr_is_a_clear_error():
    from helpers.harness import RankFailed

    with pytest.raises(RankFailed, match="found an MPI launch .* but no MASTER_ADDR"):
        run_ranks(1, _mpi_without_master_addr, init=False)


def _bad_rank_arguments(rank, world_size):
    zero_ext.init_distributed(rank=rank, world_size=world_size, verbose=False)


@pytest.mark.parametrize("rank, world_size, message", [
    (0, -1, "give both rank and world_size"),
    (-1, 2, "give both rank and world_size"),
    (2, 2, "rank 2 is out of range for world_size 2"),
])
def test_bad_rank_arguments(rank, world_size, message):
    from helpers.harness import RankFailed

    with pytest.raises(RankFailed, match=message):
        run_ranks(1, _bad_rank_arguments, rank, world_size, init=False)


def _dead_peer_times_out():
    import time

    zero_ext.init_distributed(verbose=False, timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(6)  # "dead" for longer than the collective timeout
        return None
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        dist.barrier()
    return time.monotonic() - start


def test_a_dead_peer_does_not_hang_the_others_past_the_timeout():
    waited, _ = run_ranks(2, _dead_peer_times_out, init=False, timeout=30)
    assert 1.5 < waited < 5.0  # rank 0 gave up after the 2 s collective timeout, not at the peer's return
