"""The native communicator (csrc/comm.h, zero_ext._C.Comm) against a Python reference, and its faults.

Ranks here are forked processes that call only zero_ext._C on raw buffers (no torch.distributed, so the
C layer is tested on its own); the parent builds every rank's inputs and the reference with torch:
- the reduction kernel, every ISA path, bit for bit against the documented order (rank order, fp32
  accumulation for fp16 / bf16, one multiply by the scale, one rounding);
- every verb at N = 1, 2, 3, 4 for each dtype, odd sizes, zero-size chunks, and slots small enough that
  one op takes many rounds;
- a rank that dies (SIGKILL), one that leaves (raises and exits), one that never arrives: every other
  rank's call ends inside the timeout with an error naming it;
- no /dev/shm file left after destroy or normal exit, and a killed run's file reaped by the next.
"""
import ctypes
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from zero_ext import _C

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3, torch.int32: 4,
         torch.int64: 5, torch.uint8: 6}
SUM, AVG, MAX, MIN = 0, 1, 2, 3
ISAS = range(["scalar", "avx2", "avx512"].index(_C.simd_supported()) + 1)  # every path this CPU runs
FORK = mp.get_context("fork")


def _random(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 4).to(dtype)
    hi = 200 if dtype == torch.uint8 else 1000
    return torch.randint(0, hi, (n,), generator=g).to(dtype)


def reference_reduce(xs, redop, scale=1.0):
    """comm.h's order: rank order, in fp32 for the 16-bit types, scale once, round once."""
    dtype = xs[0].dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = xs[0].to(wide).clone()
    for x in xs[1:]:
        x = x.to(wide)
        if redop in (SUM, AVG):
            acc = acc + x
        elif redop == MAX:
            acc = torch.where(torch.isnan(x) | (x > acc), x, acc) if dtype.is_floating_point else torch.maximum(acc, x)
        else:
            acc = torch.where(torch.isnan(x) | (x < acc), x, acc) if dtype.is_floating_point else torch.minimum(acc, x)
    if redop == AVG:
        scale = scale / len(xs)
    if scale != 1.0:
        acc = acc * torch.tensor(scale, dtype=wide)
    return acc.to(dtype)


# ---------------------------------------------------------------------------------------------------
# The kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reduce_kernel_every_isa_gives_the_reference_bits(dtype):
    for isa in ISAS:
        for n in (1, 2, 3, 5):
            for count in (0, 1, 15, 16, 17, 33, 1000):
                for redop, scale in ((SUM, 1.0), (SUM, 0.25), (AVG, 1.0), (MAX, 1.0), (MIN, 1.0)):
                    xs = [_random(count, dtype, 10 * k + count) for k in range(n)]
                    out, copy = torch.empty(count, dtype=dtype), torch.empty(count, dtype=dtype)
                    _C.comm_reduce_kernel(CODES[dtype], redop, scale, [x.data_ptr() for x in xs],
                                          out.data_ptr(), count, isa, copy.data_ptr())
                    want = reference_reduce(xs, redop, scale)
                    bits = torch.int16 if dtype != torch.float32 else torch.int32
                    # the second destination (a split all-reduce's slot) gets the same bits
                    for got in (out, copy):
                        assert torch.equal(got.view(bits), want.view(bits)), (isa, n, count, redop, scale)


def test_reduce_kernel_max_and_min_keep_nan_from_any_rank():
    for isa in ISAS:
        a = torch.tensor([1.0, float("nan"), 3.0] * 7)
        b = torch.tensor([float("nan"), 2.0, 1.0] * 7)
        for redop in (MAX, MIN):
            out = torch.empty_like(a)
            _C.comm_reduce_kernel(0, redop, 1.0, [a.data_ptr(), b.data_ptr()], out.data_ptr(), a.numel(), isa)
            assert torch.isnan(out[0::3]).all() and torch.isnan(out[1::3]).all()
            assert (out[2::3] == (3.0 if redop == MAX else 1.0)).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.uint8])
def test_reduce_kernel_plain_types(dtype):
    xs = [_random(37, dtype, k) for k in range(3)]
    for redop in (SUM, MAX, MIN) + ((AVG,) if dtype.is_floating_point else ()):
        out = torch.empty(37, dtype=dtype)
        _C.comm_reduce_kernel(CODES[dtype], redop, 1.0, [x.data_ptr() for x in xs], out.data_ptr(), 37, -1)
        assert torch.equal(out, reference_reduce(xs, redop)), redop


def test_reduce_kernel_refuses_average_and_scale_of_integers():
    x = torch.zeros(4, dtype=torch.int32)
    for redop, scale in ((AVG, 1.0), (SUM, 0.5)):
        with pytest.raises(ValueError):
            _C.comm_reduce_kernel(4, redop, scale, [x.data_ptr()], x.data_ptr(), 4, -1)


# ---------------------------------------------------------------------------------------------------
# Ranks as forked processes


def _join(cid, rank, world, timeout_s=30.0, slot_bytes=0):
    deadline = time.monotonic() + 20
    while True:  # rank 0 creates the segment; the others attach once it exists
        try:
            return _C.Comm(cid, rank, world, timeout_s, slot_bytes)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _spawn(world, target, *args, expect=None):
    """Runs target(conn, rank, world, *args) on `world` forked ranks; the replies of the first `expect`
    (default: all; fewer where the last ranks may die without answering), rank by rank."""
    pipes, procs = [], []
    for r in range(world):
        parent, child = FORK.Pipe()
        p = FORK.Process(target=_rank_entry, args=(target, child, r, world) + args, daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    replies = []
    for conn in pipes[:world if expect is None else expect]:
        if not conn.poll(120):
            raise TimeoutError("a rank did not answer")
        replies.append(conn.recv())
    for p in procs:
        p.join(10)
    return replies


def _rank_entry(target, conn, rank, world, *args):
    try:
        conn.send(("ok", _plain(target(conn, rank, world, *args))))
    except BaseException as e:  # noqa: BLE001 - the parent asserts on it
        conn.send(("error", type(e).__name__, str(e)))


class _Bytes:
    """A tensor as plain bytes: torch's own pickling would hand it over through shared memory that
    goes away with this short-lived process."""

    def __init__(self, t):
        self.dtype, self.data = t.dtype, t.contiguous().view(torch.uint8).numpy().tobytes()

    def tensor(self):
        if not self.data:
            return torch.empty(0, dtype=self.dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(self.dtype).clone()


def _plain(x):
    if isinstance(x, torch.Tensor):
        return _Bytes(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _verbs(conn, rank, world, cid, slot, plan):
    """Runs each (verb, dtype, ...) of plan on this rank's inputs; returns the output bytes."""
    comm = _join(cid, rank, world, slot_bytes=slot)
    if rank == 0:
        time.sleep(0.05)
    outs = []
    for verb, dtype, count, redop, scale, root, inputs in plan:
        x = inputs[rank].clone()
        if verb == "all_gather":
            out = torch.empty(world * count, dtype=dtype)
            comm.all_gather(x.data_ptr(), out.data_ptr(), x.numel() * x.element_size()).wait()
        elif verb == "all_gather_in_place":  # the input is this rank's part of the output
            out = torch.zeros(world * count, dtype=dtype)
            own = out[rank * count:(rank + 1) * count]
            own.copy_(x)
            comm.all_gather(own.data_ptr(), out.data_ptr(), own.numel() * own.element_size()).wait()
        elif verb == "all_gather_group":  # pieces of count, count // 2 and 3 elements
            sizes = [count, count // 2, 3]
            ins = list(torch.split(torch.cat([x, x[:count // 2], x[:3]]), sizes)) if count >= 3 else [x]
            ins = [t.clone() for t in ins]
            bufs = [torch.empty(world * t.numel(), dtype=dtype) for t in ins]
            comm.all_gather_group([t.data_ptr() for t in ins], [b.data_ptr() for b in bufs],
                                  [t.numel() * t.element_size() for t in ins]).wait()
            out = torch.cat(bufs)
        elif verb == "all_gather_v":  # rank r sends count + r elements
            mine = torch.cat([x, x[:rank]]) if rank <= count else x
            counts = [(count + r if r <= count else count) * x.element_size() for r in range(world)]
            out = torch.empty(sum(counts) // x.element_size(), dtype=dtype)
            comm.all_gather_v(mine.data_ptr(), out.data_ptr(), counts).wait()
        elif verb == "reduce_scatter":
            out = torch.empty(count // world, dtype=dtype)
            comm.reduce_scatter(x.data_ptr(), out.data_ptr(), out.numel(), CODES[dtype], redop, scale).wait()
        elif verb == "all_reduce":  # in place
            comm.all_reduce(x.data_ptr(), x.data_ptr(), count, CODES[dtype], redop, scale).wait()
            out = x
        elif verb == "reduce":
            out = torch.zeros(count, dtype=dtype)
            comm.reduce(x.data_ptr(), out.data_ptr(), count, CODES[dtype], redop, scale, root).wait()
        elif verb == "broadcast":
            comm.broadcast(x.data_ptr(), x.numel() * x.element_size(), root).wait()
            out = x
        elif verb == "scatter":
            out = torch.empty(count // world, dtype=dtype)
            comm.scatter(x.data_ptr(), out.data_ptr(), out.numel() * out.element_size(), root).wait()
        else:
            comm.barrier().wait()
            out = torch.empty(0)
        outs.append(out)
    ops = comm.ops
    comm.destroy()
    return outs, ops


def _expected(verb, dtype, count, redop, scale, root, inputs, rank, world):
    xs = inputs
    if verb in ("all_gather", "all_gather_in_place"):
        return torch.cat(xs)
    if verb == "all_gather_group":
        if count < 3:
            return torch.cat(xs)
        pieces = [[x, x[:count // 2], x[:3]] for x in xs]
        return torch.cat([torch.cat([p[j] for p in pieces]) for j in range(3)])
    if verb == "all_gather_v":
        return torch.cat([torch.cat([x, x[:r]]) if r <= count else x for r, x in enumerate(xs)])
    if verb == "reduce_scatter":
        chunk = count // world
        return reference_reduce([x[rank * chunk:(rank + 1) * chunk] for x in xs], redop, scale)
    if verb == "all_reduce":
        return reference_reduce(xs, redop, scale)
    if verb == "reduce":
        return reference_reduce(xs, redop, scale) if rank == root else torch.zeros(count, dtype=dtype)
    if verb == "broadcast":
        return xs[root]
    if verb == "scatter":
        chunk = count // world
        return xs[root][rank * chunk:(rank + 1) * chunk]
    return torch.empty(0)


def _plan(world):
    plan = []
    sizes = (0, 1, 7, 1029, 3001)  # odd; 3001 * 4 bytes spans several 4 KiB slots
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                               torch.uint8)):
        for count in sizes:
            ins = [_random(count, dtype, 1000 * r + count + i) for r in range(world)]
            root = (count + i) % world
            for verb in ("all_gather", "all_gather_in_place", "all_gather_group", "all_gather_v",
                         "broadcast"):
                plan.append((verb, dtype, count, SUM, 1.0, root, ins))
            big = [_random(world * count, dtype, 7 + 1000 * r + count + i) for r in range(world)]
            plan.append(("scatter", dtype, world * count, SUM, 1.0, root, big))
            redops = [(SUM, 1.0), (MAX, 1.0)]
            if dtype.is_floating_point:
                redops += [(AVG, 1.0), (SUM, 0.5), (MIN, 1.0)]
            for redop, scale in redops[: 2 + (count % 3)]:  # pairwise-ish: not every op at every size
                plan.append(("reduce_scatter", dtype, world * count, redop, scale, root, big))
                plan.append(("all_reduce", dtype, count, redop, scale, root, ins))
                plan.append(("reduce", dtype, count, redop, scale, root, ins))
    plan.append(("barrier", torch.float32, 0, SUM, 1.0, 0, [torch.empty(0)] * world))
    return plan


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_verb_matches_the_reference(world):
    plan = _plan(world)
    cid = _C.comm_unique_id()
    replies = _spawn(world, _verbs, cid, 4096, plan)
    for rank, reply in enumerate(replies):
        assert reply[0] == "ok", reply
        outs, ops = reply[1]
        outs = [o.tensor() for o in outs]
        assert ops == len(plan)
        for (verb, dtype, count, redop, scale, root, ins), out in zip(plan, outs):
            want = _expected(verb, dtype, count, redop, scale, root, ins, rank, world)
            assert out.dtype == want.dtype and out.shape == want.shape, (verb, dtype, count)
            same = torch.equal(out, want) or (dtype.is_floating_point and torch.equal(out.isnan(), want.isnan())
                                               and torch.equal(out.nan_to_num(), want.nan_to_num()))
            assert same, f"rank {rank}: {verb} {dtype} count={count} redop={redop} scale={scale}"
    assert not _segments(cid)


def _async_overlap(conn, rank, world, cid):
    """Several ops in flight at once complete in call order, each with its own result."""
    comm = _join(cid, rank, world)
    xs = [torch.full((5000,), float(rank + k)) for k in range(8)]
    ops = [comm.all_reduce(x.data_ptr(), x.data_ptr(), x.numel(), 0, SUM, 1.0) for x in xs]
    done_before = sum(op.test() for op in ops)
    for op in ops:
        op.wait()
    comm.destroy()
    return [x[0].item() for x in xs], done_before


def test_ops_in_flight_run_in_call_order():
    replies = _spawn(2, _async_overlap, _C.comm_unique_id())
    for reply in replies:
        assert reply[0] == "ok", reply
        assert reply[1][0] == [float(1 + 2 * k) for k in range(8)]


def _blocking_then_async(conn, rank, world, cid):
    """Blocking ops (promised with defer_next, as the facade's blocking calls do) run on the caller's
    thread: the progress thread runs none of them. Async ops are still handed to it."""
    comm = _join(cid, rank, world)
    x = torch.full((5000,), float(rank + 1))
    for _ in range(50):
        comm.defer_next()
        comm.all_reduce(x.data_ptr(), x.data_ptr(), x.numel(), 0, SUM, 0.5).wait()
    blocking = comm.handed_off
    ops = [comm.all_reduce(x.data_ptr(), x.data_ptr(), x.numel(), 0, SUM, 0.5) for _ in range(8)]
    deadline = time.monotonic() + 60
    while not all(op.test() for op in ops) and time.monotonic() < deadline:
        time.sleep(0.001)  # nobody waits: only the progress thread can run them
    done = [op.test() for op in ops]
    handed = comm.handed_off
    comm.destroy()
    return blocking, done, handed, x[0].item()


def test_a_blocking_op_runs_on_its_caller_and_async_ops_on_the_progress_thread():
    replies = _spawn(2, _blocking_then_async, _C.comm_unique_id())
    for reply in replies:
        assert reply[0] == "ok", reply
        blocking, done, handed, value = reply[1]
        assert blocking == 0  # without defer_next the progress thread, woken, takes some of them
        assert done == [1] * 8 and handed == 8
        assert value == 1.5  # (1 + 2) / 2 stays 1.5 through every averaged all-reduce


# ---------------------------------------------------------------------------------------------------
# Faults: each ends every other rank's call inside the timeout, naming the rank


def _victim(conn, rank, world, cid, fault, timeout_s):
    comm = _join(cid, rank, world, timeout_s=timeout_s)
    comm.barrier().wait()  # everyone attached
    if rank == world - 1:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "leave":
            comm.destroy()
            return "left"
        time.sleep(timeout_s + 1.5)  # "absent": alive, never arrives
        return "slept"
    x = torch.ones(1000)
    start = time.monotonic()
    try:
        comm.all_reduce(x.data_ptr(), x.data_ptr(), x.numel(), 0, SUM, 1.0).wait()
    except OSError as e:
        took = time.monotonic() - start
        # after the first error every later op fails at once, with that error
        try:
            comm.barrier().wait()
            again = None
        except OSError as e2:
            again = str(e2)
        comm.destroy()
        return type(e).__name__, str(e), took, again
    return "no error"


# limits: far below a real collective timeout, with room for a loaded machine's scheduling (the error
# type tells a detected death or departure from a timeout)
@pytest.mark.parametrize("fault,error,limit", [
    ("kill", "BrokenPipeError", 5.0),
    ("leave", "ConnectionResetError", 5.0),
    ("absent", "TimeoutError", 1.0 + 3.0),
])
def test_a_faulty_rank_is_named_inside_the_timeout(fault, error, limit):
    world, timeout_s = 3, 1.0
    replies = _spawn(world, _victim, _C.comm_unique_id(), fault, timeout_s,
                                         expect=world - 1 if fault == "kill" else world)
    for rank, reply in enumerate(replies[:world - 1]):
        assert reply[0] == "ok", reply
        name, message, took, again = reply[1]
        assert name == error, message
        assert f"rank {world - 1}" in message, message
        assert took <= limit, f"rank {rank} took {took:.2f} s"
        assert again and "not run" in again, again
    if fault == "absent":
        assert replies[-1] == ("ok", "slept")


RAISING_RANK = r"""
import sys, time
import zero_ext._C as C
cid = sys.argv[1]
for _ in range(2000):
    try:
        comm = C.Comm(cid, 1, 2, 60.0)
        break
    except FileNotFoundError:
        time.sleep(0.005)
comm.barrier().wait()
from zero_ext.comm import native
native._LIVE.append(native.Native(comm, [0, 1]))  # as the facade keeps it: destroyed at exit
raise RuntimeError("rank 1 fails in Python")
"""


def test_a_rank_that_raises_in_python_fails_the_others():
    cid = _C.comm_unique_id()
    comm = _C.Comm(cid, 0, 2, 60.0)  # (the child's start, importing torch, takes seconds under load)
    proc = subprocess.Popen([sys.executable, "-c", RAISING_RANK, cid], stderr=subprocess.PIPE)
    comm.barrier().wait()
    x = torch.ones(10)
    start = time.monotonic()
    with pytest.raises(ConnectionResetError, match="rank 1 left before arriving"):
        comm.all_reduce(x.data_ptr(), x.data_ptr(), 10, 0, SUM, 1.0).wait()
    assert time.monotonic() - start < 5
    assert proc.wait(30) == 1 and b"rank 1 fails in Python" in proc.stderr.read()
    comm.destroy()


# ---------------------------------------------------------------------------------------------------
# /dev/shm


def _segments(cid=None):
    names = [n for n in os.listdir("/dev/shm") if n.startswith("zx-comm-")]
    return [n for n in names if cid is None or n == cid.lstrip("/")]


def test_segment_is_0600_and_gone_after_unlink_and_destroy():
    cid = _C.comm_unique_id()
    comm = _C.Comm(cid, 0, 1, 5.0)
    assert _segments(cid)
    assert os.stat("/dev/shm" + cid).st_mode & 0o777 == 0o600
    comm.unlink()
    assert not _segments(cid)
    x = torch.arange(4.0)
    comm.all_reduce(x.data_ptr(), x.data_ptr(), 4, 0, SUM, 1.0).wait()  # still works
    comm.destroy()
    comm.destroy()  # idempotent
    with pytest.raises(ValueError, match="destroyed"):
        comm.barrier()
    cid = _C.comm_unique_id()
    _C.Comm(cid, 0, 1, 5.0).destroy()  # never unlinked: destroy removes it
    assert not _segments(cid)


def _killed_creator(conn, rank, world, cid):
    comm = _C.Comm(cid, 0, 2, 5.0)  # noqa: F841 - alive (not destroyed) when the kill comes
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_runs_segment_is_reaped_by_the_next_run():
    dead = _C.comm_unique_id()
    _spawn(1, _killed_creator, dead, expect=0)
    assert _segments(dead), "the killed creator's segment should still be there"
    live = _C.comm_unique_id()
    keep = _C.Comm(live, 0, 2, 5.0)  # alive (its lock held), as old as the dead one
    old = time.time() - 3600
    for cid in (dead, live):
        os.utime("/dev/shm" + cid, (old, old))
    _C.comm_unique_id()
    assert not _segments(dead) and _segments(live)
    keep.destroy()
    assert not _segments(live)
