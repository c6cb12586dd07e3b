"""The NCCL transport: libzx_cuda.so's communicators (csrc/comm_nccl.c, through _native/cuda.py) for the
CUDA tensors of a process group. UNVERIFIED: written and compiled on a machine without a GPU; the
tests marked ``gpu`` (benchmarks/gpu_suite.sh) are what checks it.

``for_group(group, device)`` decides once per (process group, device), the same way on every rank: an
``Nccl`` when the CUDA library was built, ``ZERO_EXT_CUDA_LIB=1`` asks for it (off by default until a GPU
has run it: _native/cuda.on_engine_path) and ``ZERO_EXT_COMM`` is not ``torch``, else None (the facade
then calls torch.distributed, i.e. ProcessGroupNCCL). The communicator is bootstrapped through the
default store (rank 0 of the group makes the unique id); if any rank cannot make or join it, every
rank falls back to torch.distributed for that group, with a warning naming why.

Ordering (torch's stream semantics, as ProcessGroupNCCL keeps them): every collective runs on one
zero_ext stream per device, which first waits for the caller's current stream (an event), so it sees
what the caller's kernels wrote; every tensor is ``record_stream``-ed on the zero_ext stream, so the
caching allocator does not hand its memory out again before the collective finished even if the
caller drops it; and the caller's current stream waits for the collective (an event) before anything
it enqueues later: at once for a blocking call, at ``Work.wait()`` for ``async_op``. The host is never
synchronised.
"""
import ctypes
import logging
import threading
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from .._native import cuda as _cuda
from .._native.dtypes import zx_dtype
from .native import mode

logger = logging.getLogger("zero_ext")

_REDOPS = {"SUM": 0, "AVG": 1, "MAX": 2, "MIN": 3}  # csrc/cuda_api.h
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8)


def _redop(op) -> Optional[int]:
    for name, code in _REDOPS.items():
        if hasattr(dist.ReduceOp, name) and op == getattr(dist.ReduceOp, name):
            return code
    return None


class Work:
    """A collective enqueued on the zero_ext stream: wait() makes the caller's current stream wait for
    it (no host synchronisation, as torch's NCCL Work); is_completed() asks the event."""

    __slots__ = ("_event", "_device", "_after")

    def __init__(self, event, device, after=None):
        self._event, self._device, self._after = event, device, after

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream(self._device).wait_event(self._event)
        after, self._after = self._after, None
        if after is not None:
            after()
        return True

    def is_completed(self) -> bool:
        return self._event.query()

    def is_success(self) -> bool:
        return self.is_completed()


class Nccl:
    """The NCCL communicator of one process group on one device, with the facade's verbs on CUDA
    tensors (contiguous, of one device)."""

    def __init__(self, comm: ctypes.c_void_p, ranks: List[int], device: torch.device, buffer_bytes: int = 0):
        self.comm, self.ranks, self.device = comm, ranks, device
        self.buffer_bytes = buffer_bytes  # device memory NCCL took when the communicator was made
        self.rank, self.world = ranks.index(dist.get_rank()), len(ranks)
        self.stream = torch.cuda.Stream(device=device)
        self.lib = _cuda.library()
        self.destroyed = False

    def group_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    def usable(self, *tensors, dtype_ok=True) -> bool:
        return all(t.is_cuda and t.device == self.device and t.is_contiguous() for t in tensors) and \
            (not dtype_ok or all(t.dtype in _DTYPES for t in tensors))

    def reducible(self, dtype: torch.dtype, op) -> bool:
        code = _redop(op)
        return dtype in _DTYPES and code is not None and (code != 1 or dtype.is_floating_point)

    def _launch(self, tensors, calls, async_op, after=None):
        """Runs calls() (the library calls, each returning a status) on the zero_ext stream, ordered
        after the caller's current stream and before what it enqueues next."""
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            for t in tensors:
                t.record_stream(self.stream)  # the allocator keeps it until the collective ran
            for status, what in calls(self.stream.cuda_stream):
                _cuda.check(status, f"NCCL {what}")
            done = torch.cuda.Event()
            done.record(self.stream)
        work = Work(done, self.device, after)
        if async_op:
            return work
        work.wait()
        return None

    def _grouped(self, steps):
        """steps(stream) -> [(status, what)], bracketed by ncclGroupStart/End (one launch)."""
        def calls(stream):
            _cuda.check(self.lib.zx_nccl_group_start(), "NCCL group start")
            try:
                out = list(steps(stream))
            finally:
                _cuda.check(self.lib.zx_nccl_group_end(), "NCCL group end")
            return out
        return calls

    # --- movement ----------------------------------------------------------------------------------

    def all_gather_into(self, output, inp, async_op=False):
        if output.numel() != inp.numel() * self.world or output.dtype != inp.dtype:
            raise ValueError(f"all_gather: output has {output.numel()} {output.dtype} elements, "
                             f"expected {self.world} x {inp.numel()} {inp.dtype}")
        return self._launch((output, inp), lambda s: [(self.lib.zx_nccl_all_gather(
            self.comm, inp.data_ptr(), output.data_ptr(), inp.numel(), zx_dtype(inp.dtype), s), "all_gather")],
            async_op)

    def all_gather_group(self, outputs, inputs, async_op=False):
        """A bucket in one NCCL group launch: rank r's inputs[j] at outputs[j][r]."""
        def steps(s):
            return [(self.lib.zx_nccl_all_gather(self.comm, i.data_ptr(), o.data_ptr(), i.numel(),
                                                 zx_dtype(i.dtype), s), "all_gather") for o, i in zip(outputs, inputs)]
        return self._launch((*outputs, *inputs), self._grouped(steps), async_op)

    def all_gather_v(self, output, inp, counts, async_op=False):
        """Rank r's counts[r] elements in rank order: one broadcast per rank, in one group launch."""
        starts = [sum(counts[:r]) for r in range(self.world)]

        def steps(s):
            return [(self.lib.zx_nccl_broadcast(
                self.comm, inp.data_ptr() if r == self.rank else output.data_ptr() + starts[r] * output.element_size(),
                output.data_ptr() + starts[r] * output.element_size(), n, zx_dtype(output.dtype), r, s), "broadcast")
                for r, n in enumerate(counts) if n]
        return self._launch((output, inp), self._grouped(steps), async_op)

    def broadcast(self, tensor, src: int, async_op=False):
        return self._launch((tensor,), lambda s: [(self.lib.zx_nccl_broadcast(
            self.comm, tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), zx_dtype(tensor.dtype),
            self.group_rank(src), s), "broadcast")], async_op)

    # --- reductions (callers check reducible() first) ----------------------------------------------

    def all_reduce(self, tensor, op, async_op=False):
        return self._launch((tensor,), lambda s: [(self.lib.zx_nccl_all_reduce(
            self.comm, tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), zx_dtype(tensor.dtype), _redop(op),
            s), "all_reduce")], async_op)

    def reduce_scatter_tensor(self, output, inp, op, async_op=False):
        if inp.numel() != output.numel() * self.world or inp.dtype != output.dtype:
            raise ValueError(f"reduce_scatter: input has {inp.numel()} {inp.dtype} elements, expected "
                             f"{self.world} x {output.numel()} {output.dtype}")
        return self._launch((output, inp), lambda s: [(self.lib.zx_nccl_reduce_scatter(
            self.comm, inp.data_ptr(), output.data_ptr(), output.numel(), zx_dtype(output.dtype), _redop(op),
            s), "reduce_scatter")], async_op)

    def destroy(self):
        if not self.destroyed:
            self.destroyed = True
            self.stream.synchronize()
            self.lib.zx_nccl_comm_destroy(self.comm)


# ---------------------------------------------------------------------------------------------------
# One communicator per (process group, device), made on its first CUDA collective

_BY_GROUP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> {device index: Nccl | None}
_LIVE: List[Nccl] = []
# reentrant: a group's finalizer (_forget) takes it, and the collector may run that finalizer on this very
# thread while it holds the lock (any allocation inside for_group), which a plain Lock deadlocks on
_LOCK = threading.RLock()


def _bootstrap(group, ranks, device) -> Optional[Nccl]:
    store = dist.distributed_c10d._get_default_store()
    me, n = ranks.index(dist.get_rank()), len(ranks)
    base = f"zero_ext/nccl/{group.group_name}/{device.index}"
    key = f"{base}/{-(-store.add(f'{base}/joins', 1) // n)}"
    comm, error, taken = ctypes.c_void_p(), "", 0
    try:
        lib = _cuda.library()
        if me == 0:
            uid = ctypes.create_string_buffer(_cuda.NCCL_ID_BYTES)
            _cuda.check(lib.zx_nccl_unique_id(uid), "NCCL unique id")
            store.set(f"{key}/id", uid.raw)
        uid = store.get(f"{key}/id")
        with torch.cuda.device(device):
            free_before = torch.cuda.mem_get_info(device)[0]
            _cuda.check(lib.zx_nccl_comm_init(ctypes.byref(comm), n, me, uid), "NCCL communicator")
            taken = max(0, free_before - torch.cuda.mem_get_info(device)[0])
    except (ImportError, _cuda.CudaLibraryError, RuntimeError) as e:
        error = str(e)
    store.set(f"{key}/ok/{me}", "!" + error if error else "ok")
    failed = [f"rank {ranks[i]}: {e[1:]}" for i, e in
              enumerate(store.get(f"{key}/ok/{i}").decode() for i in range(n)) if e != "ok"]
    if failed:
        if comm.value:
            _cuda.library().zx_nccl_comm_abort(comm)
        logger.warning("zero_ext: the NCCL transport is unavailable for group %s (%s); using "
                       "torch.distributed", group.group_name, "; ".join(failed))
        return None
    return Nccl(comm, ranks, device, taken)


def for_group(group, device: torch.device) -> Optional[Nccl]:
    """The NCCL communicator of `group` (None: the default group) on `device`, made on first use; None
    where torch.distributed carries its CUDA collectives."""
    if not dist.is_initialized() or mode() != "native" or not _cuda.on_engine_path() or not _cuda.available():
        return None
    group = group or dist.distributed_c10d._get_default_group()
    per_device = _BY_GROUP.get(group)
    if per_device is not None and device.index in per_device:
        return per_device[device.index]
    with _LOCK:
        per_device = _BY_GROUP.setdefault(group, {})
        if device.index not in per_device:
            nccl = None
            if dist.get_rank(group) >= 0:
                nccl = _bootstrap(group, dist.get_process_group_ranks(group), device)
            per_device[device.index] = nccl
            if nccl is not None:
                _LIVE.append(nccl)
                weakref.finalize(group, _forget, nccl)
        return per_device[device.index]


def buffer_bytes() -> int:
    """Device memory this rank's NCCL communicators took when they were made (their channels' buffers,
    measured as the drop in free device memory across ncclCommInitRank; connections NCCL opens lazily
    at a first collective of a new kind are not in it): the memory report's comm buffers."""
    return sum(n.buffer_bytes for n in _LIVE if not n.destroyed)


def _forget(nccl: Nccl):
    with _LOCK:
        if nccl in _LIVE:
            _LIVE.remove(nccl)
    nccl.destroy()


def destroy_group(group):
    """Destroys `group`'s NCCL communicators, if it has any."""
    with _LOCK:
        per_device = _BY_GROUP.pop(group, None) or {}
    for nccl in per_device.values():
        if nccl is not None:
            _forget(nccl)


def destroy_all():
    """Destroys every NCCL communicator (after its stream's work): at exit and with the process group."""
    with _LOCK:
        live = list(_LIVE)
        _LIVE.clear()
        _BY_GROUP.clear()
    for nccl in live:
        nccl.destroy()
