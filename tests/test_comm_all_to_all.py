"""The native communicator's all-to-all (csrc/comm.h zx_comm_all_to_all / _v, zero_ext._C.Comm) against a
Python reference, its faults, and the facade's all_to_all_single on both transports.

Ranks are forked processes calling only zero_ext._C on raw buffers (test_comm_native.py's harness):
- even chunks at N = 1, 2, 3, 4 for chunk sizes 0, 1, odd and larger than the 4 KiB slot (many rounds),
  several ops in flight at once;
- uneven chunks from count matrices with zeros (whole rows and columns), odd sizes, one rank sending
  everything;
- an absent rank named inside the timeout; bad arguments refused before anything is enqueued;
- through torch.distributed: the facade's all_to_all_single (even, uneven, async, 2-D rows) gives
  gloo's results.
"""
import random
import re

import pytest
import torch

from helpers.harness import run_ranks
from test_comm_native import _join, _random, _segments, _spawn
from zero_ext import _C

SLOT = 4096


def _even(conn, rank, world, cid, plan):
    """plan: (bytes per chunk, every rank's input); each op issued before any is waited for."""
    comm = _join(cid, rank, world, slot_bytes=SLOT)
    ins = [inputs[rank].clone() for _, inputs in plan]
    outs = [torch.full((world * chunk,), 0xAB, dtype=torch.uint8) for chunk, _ in plan]
    ops = [comm.all_to_all(x.data_ptr(), o.data_ptr(), chunk) for (chunk, _), x, o in zip(plan, ins, outs)]
    for op in ops:
        op.wait()
    comm.destroy()
    return outs


def _even_plan(world):
    plan = []
    for chunk in (0, 1, 7, 1029, 3 * SLOT + 5):
        plan.append((chunk, [_random(world * chunk, torch.uint8, 100 * r + chunk) for r in range(world)]))
    return plan


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_even_chunks_match_the_reference(world):
    plan = _even_plan(world)
    cid = _C.comm_unique_id()
    for rank, reply in enumerate(_spawn(world, _even, cid, plan)):
        assert reply[0] == "ok", reply
        for (chunk, inputs), out in zip(plan, reply[1]):
            want = torch.cat([x[rank * chunk:(rank + 1) * chunk] for x in inputs]) if chunk else \
                torch.empty(0, dtype=torch.uint8)
            assert torch.equal(out.tensor(), want), (rank, chunk)
    assert not _segments(cid)


def _uneven(conn, rank, world, cid, plan):
    comm = _join(cid, rank, world, slot_bytes=SLOT)
    outs = []
    for counts, inputs in plan:
        x = inputs[rank].clone()
        out = torch.full((sum(counts[s * world + rank] for s in range(world)),), 0xAB, dtype=torch.uint8)
        comm.all_to_all_v(x.data_ptr() if x.numel() else 0, out.data_ptr() if out.numel() else 0, counts).wait()
        outs.append(out)
    comm.destroy()
    return outs


def _uneven_plan(world):
    rng = random.Random(world)
    plan = []
    for case in range(6):
        counts = [rng.choice((0, 1, 3, 17, 1001, SLOT + 3)) for _ in range(world * world)]
        if case == 1:  # rank 0 sends nothing, and the last rank receives nothing
            counts = [0 if s == 0 or d == world - 1 else c for s in range(world) for d, c in
                      enumerate(counts[s * world:(s + 1) * world])]
        if case == 2:  # only rank 0 sends, 2 slots' worth to every rank
            counts = [2 * SLOT + 1 if s == 0 else 0 for s in range(world) for _ in range(world)]
        if case == 3:
            counts = [0] * (world * world)
        inputs = [_random(sum(counts[s * world:(s + 1) * world]), torch.uint8, 7 * s + case) for s in range(world)]
        plan.append((counts, inputs))
    return plan


def _uneven_expected(counts, inputs, world, rank):
    parts = []
    for s in range(world):
        off = sum(counts[s * world:s * world + rank])
        parts.append(inputs[s][off:off + counts[s * world + rank]])
    return torch.cat(parts)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_uneven_chunks_with_zeros_match_the_reference(world):
    plan = _uneven_plan(world)
    cid = _C.comm_unique_id()
    for rank, reply in enumerate(_spawn(world, _uneven, cid, plan)):
        assert reply[0] == "ok", reply
        for (counts, inputs), out in zip(plan, reply[1]):
            assert torch.equal(out.tensor(), _uneven_expected(counts, inputs, world, rank)), (rank, counts)


def _absent(conn, rank, world, cid, timeout_s):
    import time

    comm = _join(cid, rank, world, timeout_s=timeout_s)
    comm.barrier().wait()
    if rank == world - 1:
        time.sleep(timeout_s + 2)  # alive, never arrives
        return "slept"
    x = torch.ones(world * 64, dtype=torch.uint8)
    out = torch.empty_like(x)
    try:
        comm.all_to_all(x.data_ptr(), out.data_ptr(), 64).wait()
    except OSError as e:
        comm.destroy()
        return type(e).__name__, str(e)
    return "no error"


def test_an_absent_rank_is_named():
    replies = _spawn(3, _absent, _C.comm_unique_id(), 2.0)
    for reply in replies[:2]:
        assert reply[0] == "ok", reply
        name, message = reply[1]
        # (rank 1 may be named too, on a machine so loaded that it took 2 s to reach the op)
        assert name == "TimeoutError" and re.search(r"all_to_all #2: rank [\d, ]*\b2 did not arrive", message), message
    assert replies[2] == ("ok", "slept")


def test_bad_arguments_are_refused_before_anything_runs():
    comm = _C.Comm(_C.comm_unique_id(), 0, 1, 5.0)
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError):  # input and output overlap
        comm.all_to_all(buf.data_ptr(), buf.data_ptr() + 8, 32)
    with pytest.raises(ValueError):
        comm.all_to_all(buf.data_ptr(), buf.data_ptr() + 32, -1)
    with pytest.raises(ValueError, match="4 counts for 1 x 1"):
        comm.all_to_all_v(buf.data_ptr(), buf.data_ptr() + 32, [1, 2, 3, 4])
    with pytest.raises(ValueError):
        comm.all_to_all_v(0, buf.data_ptr(), [5])  # sends 5 bytes from nowhere
    assert comm.ops == 0
    comm.destroy()


# ---------------------------------------------------------------------------------------------------
# The facade


def _facade_all_to_all():
    from zero_ext import comm

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {"transport": comm.transport()}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = (torch.arange(world * 6) + 100 * rank).to(dtype)
        even = torch.empty_like(x)
        comm.all_to_all_single(even, x)
        rows = x.view(world * 2, 3)
        even_rows = torch.empty_like(rows)
        comm.all_to_all_single(even_rows, rows, async_op=True).wait()
        sent = [(rank + d) % 3 for d in range(world)]  # rows to rank d, zeros among them
        got = [(s + rank) % 3 for s in range(world)]
        src = (torch.arange(sum(sent) * 2) + 1000 * rank).to(dtype).view(-1, 2)
        uneven = torch.full((sum(got), 2), -1).to(dtype)
        comm.all_to_all_single(uneven, src, got, sent)
        strided = torch.empty(2, world * 6, dtype=dtype).t()[:, 0]  # a non-contiguous output
        comm.all_to_all_single(strided, x)
        out[str(dtype)] = [t.float().tolist() for t in (even, even_rows, uneven, strided)]
    return out


def test_the_facade_gives_the_same_results_as_gloo():
    for world in (2, 3):
        native = run_ranks(world, _facade_all_to_all)
        on_torch = run_ranks(world, _facade_all_to_all, env={"ZERO_EXT_COMM": "torch"})
        for rank in range(world):
            assert native[rank].pop("transport") == "native shared memory"
            assert on_torch[rank].pop("transport") == "torch.distributed"
            assert native[rank] == on_torch[rank], f"world {world}, rank {rank}"
