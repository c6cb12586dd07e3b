"""Ranks in different collectives on the native transport: each op's first round carries its name,
number, size and reduction (csrc/comm_shm.h, struct shm_stamp), compared by every rank before a byte is
read, so a mismatch is a CommError on every rank at once naming both ops — never bytes of another op
exchanged silently, never a wait until the timeout."""
import time

import pytest
import torch

from helpers.harness import run_ranks

BOUND_S = 20  # generous (2 loaded cores): a mismatch fails at the first barrier, in milliseconds when quiet


def _mismatched(case):
    import torch.distributed as dist
    from zero_ext import comm
    from zero_ext.comm import native

    comm.barrier()  # (the communicator exists and both ranks are here)
    rank = dist.get_rank()
    start = time.monotonic()
    try:
        if case == "verbs":  # rank 0: all_gather of 4 KiB each; rank 1: all_reduce of 8 KiB
            if rank == 0:
                comm.all_gather_into(torch.empty(2 * 1024), torch.ones(1024))
            else:
                comm.all_reduce(torch.ones(2048))
        elif case == "sizes":
            comm.all_reduce(torch.ones(1024 * (rank + 1)))
        else:  # an agreement against a collective
            if rank == 0:
                native.for_group().agree("save_checkpoint")
            else:
                comm.all_reduce(torch.ones(4))
        return "ok", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - every rank's outcome goes back to the test
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


@pytest.mark.parametrize("case,ops", [
    ("verbs", ("all_gather #2 (4096 bytes)", "all_reduce #2 (8192 bytes, dtype 0, sum)")),
    ("sizes", ("all_reduce #2 (4096 bytes, dtype 0, sum)", "all_reduce #2 (8192 bytes, dtype 0, sum)")),
    ("agreement", ("save_checkpoint #2 (0 bytes)", "all_reduce #2 (16 bytes, dtype 0, sum)")),
])
def test_ranks_in_different_collectives_fail_at_once_naming_both(case, ops):
    results = run_ranks(2, _mismatched, case, timeout=60)
    for rank, (message, seconds) in enumerate(results):
        assert seconds < BOUND_S, (rank, seconds, message)
        assert message.startswith("CommError") and "ranks in different collectives" in message, message
        mine, theirs = ops[rank], ops[1 - rank]
        assert f"rank {rank} in {mine}, rank {1 - rank} in {theirs}" in message, message
