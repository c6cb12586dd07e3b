"""The native transport: zero_ext._C's shared-memory communicator (csrc/comm.h) for the CPU tensors of
a process group whose ranks are all on this host.

``for_group(group)`` decides once per process group, the same way on every rank: a ``Native`` when
the group's ranks share this host's /dev/shm (and ``ZERO_EXT_COMM`` is not ``torch``), else None
(the facade then calls torch.distributed). The communicator is bootstrapped through the default
store (torch.distributed stays the rendezvous): rank 0 of the group creates the segment and publishes
its id; every rank attaches and says so; rank 0 then removes the segment's name, so nothing is left in
/dev/shm whatever happens later. A group whose communicator cannot be made (no /dev/shm space, ...)
falls back to torch.distributed on every rank, with a warning naming why.

``Native``'s verbs take tensors and return a ``Work`` (wait / is_completed, as torch's); the tensors
stay referenced by the op until it ran. Non-contiguous tensors go through contiguous copies.
"""
import atexit
import logging
import math
import os
import socket
import threading
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import _C

logger = logging.getLogger("zero_ext")

# csrc/dtype.h's codes, for the reductions (movements go by bytes and take any dtype)
_REDUCE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3,
                  torch.int32: 4, torch.int64: 5, torch.uint8: 6}
_FLOATING = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class CommError(dist.DistBackendError if hasattr(dist, "DistBackendError") else RuntimeError):
    """A native collective failed: a rank died, left, or did not arrive within the timeout. The
    message names the collective and the rank; the communicator cannot be used again."""


def mode() -> str:
    """ZERO_EXT_COMM: 'native' (the default: shared memory where the group allows it) or 'torch'."""
    value = os.environ.get("ZERO_EXT_COMM", "native").strip().lower() or "native"
    if value not in ("native", "torch"):
        raise ValueError(f"ZERO_EXT_COMM must be 'native' or 'torch', not {value!r}")
    return value


def redop_code(op) -> Optional[int]:
    """comm.h's code for a torch ReduceOp it implements, else None."""
    for name, code in (("SUM", 0), ("AVG", 1), ("MAX", 2), ("MIN", 3)):
        if hasattr(dist.ReduceOp, name) and op == getattr(dist.ReduceOp, name):
            return code
    return None


class Work:
    """An op in flight: wait() (raises CommError when it failed) and is_completed(), as torch's."""

    __slots__ = ("_op", "_after", "_error")

    def __init__(self, op, keep, after=None):
        op.keep = keep  # released by the op itself, only after it ran
        self._op, self._after, self._error = op, after, None

    def wait(self, timeout=None) -> bool:
        if self._error is None and self._op is not None:
            try:
                self._op.wait()
            except OSError as e:
                self._error = CommError(f"zero_ext native collective failed: {e.strerror}")
            else:
                after, self._after = self._after, None
                if after is not None:
                    after()
                self._op = None
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._op is None or self._op.test()

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None


def _contiguous(t: torch.Tensor):
    """(a contiguous tensor with t's values, a callback copying it back into t or None)."""
    if t.is_contiguous():
        return t, None
    c = t.contiguous()
    return c, (lambda: t.copy_(c))


def _flat_run(tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The one contiguous buffer the tensors tile in order (as a view), or None."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.numel() == first.numel() for t in tensors):
        return None
    step = first.numel() * first.element_size()
    base = first.data_ptr()
    if any(t.data_ptr() != base + i * step for i, t in enumerate(tensors)):
        return None
    if first.untyped_storage().nbytes() < first.storage_offset() * first.element_size() + step * len(tensors):
        return None
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                   (first.numel() * len(tensors),))


def _splits(sizes, t: torch.Tensor, world: int, what: str) -> List[int]:
    """Rows per rank of ``t``: the given split sizes, or an even split of dim 0."""
    rows = t.shape[0] if t.dim() else 1
    if sizes is None:
        if rows % world:
            raise ValueError(f"all_to_all_single: {rows} {what} rows do not split evenly over {world} ranks")
        return [rows // world] * world
    sizes = [int(n) for n in sizes]
    if len(sizes) != world or sum(sizes) != rows or min(sizes) < 0:
        raise ValueError(f"all_to_all_single: {what}_split_sizes {sizes} must be {world} counts adding up to "
                         f"the {rows} rows of the {what}")
    return sizes


class Native:
    """The communicator of one process group, with torch.distributed's verbs on CPU tensors."""

    def __init__(self, comm, ranks):
        self.comm, self.ranks = comm, ranks
        self.rank, self.world = comm.rank, comm.world

    def _issue(self, async_op, verb, *args):
        """verb(*args), an op of this communicator. A blocking call runs its op on this thread at the wait
        (zx_comm_wait), so its enqueue need not wake the progress thread (comm.h, zx_comm_defer_next)."""
        if async_op:
            return verb(*args)
        self.comm.defer_next()
        try:
            return verb(*args)
        except BaseException:
            self.comm.defer_next(False)
            raise

    def _run(self, op, keep, after, async_op):
        work = Work(op, keep, after)
        if async_op:
            return work
        work.wait()
        return None

    def group_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    # --- movement ----------------------------------------------------------------------------------

    def all_gather_into(self, output: torch.Tensor, inp: torch.Tensor, async_op=False):
        if output.numel() != inp.numel() * self.world or output.dtype != inp.dtype:
            raise ValueError(f"all_gather: output has {output.numel()} {output.dtype} elements, "
                             f"expected {self.world} x {inp.numel()} {inp.dtype}")
        out, back = _contiguous(output)
        src = inp if inp.is_contiguous() else inp.contiguous()
        op = self._issue(async_op, self.comm.all_gather, src.data_ptr(), out.data_ptr(),
                         src.numel() * src.element_size())
        return self._run(op, (out, src, output), back, async_op)

    def all_gather(self, outputs: List[torch.Tensor], inp: torch.Tensor, async_op=False):
        if len(outputs) != self.world:
            raise ValueError(f"all_gather: {len(outputs)} output tensors for {self.world} ranks")
        flat = _flat_run(outputs)
        if flat is not None:
            return self.all_gather_into(flat, inp, async_op)
        staging = inp.new_empty((self.world * inp.numel(),))

        def unpack():
            for t, piece in zip(outputs, staging.view(self.world, -1)):
                t.copy_(piece.view_as(t))
        src = inp.contiguous()
        op = self._issue(async_op, self.comm.all_gather, src.data_ptr(), staging.data_ptr(),
                         src.numel() * src.element_size())
        return self._run(op, (staging, src, outputs), unpack, async_op)

    def all_gather_group(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], async_op=False):
        """A bucket in one op, no flatten copy: rank r's inputs[j] at outputs[j][r]."""
        for o, i in zip(outputs, inputs):
            if not (o.is_contiguous() and i.is_contiguous()) or o.numel() != i.numel() * self.world:
                raise ValueError("all_gather_group: contiguous outputs of world x input elements")
        op = self._issue(async_op, self.comm.all_gather_group, [t.data_ptr() for t in inputs],
                         [t.data_ptr() for t in outputs], [t.numel() * t.element_size() for t in inputs])
        return self._run(op, (outputs, inputs), None, async_op)

    def all_gather_v(self, output: torch.Tensor, inp: torch.Tensor, counts, async_op=False):
        size = output.element_size()
        src = inp if inp.is_contiguous() else inp.contiguous()
        op = self._issue(async_op, self.comm.all_gather_v, src.data_ptr(), output.data_ptr(),
                         [c * size for c in counts])
        return self._run(op, (output, src), None, async_op)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes=None,
                          input_split_sizes=None, async_op=False):
        """torch.distributed.all_to_all_single: chunk d of ``inp`` (rows, split by input_split_sizes or
        evenly) to rank d, rank s's chunk into chunk s of ``output``. Uneven splits first all-gather
        every rank's input splits (the op needs the whole matrix of sizes), then run as one op."""
        if output.dtype != inp.dtype:
            raise ValueError(f"all_to_all_single: output is {output.dtype}, input {inp.dtype}")
        row = math.prod(inp.shape[1:]) * inp.element_size()  # bytes of one row of dim 0
        out, back = _contiguous(output)
        src = inp if inp.is_contiguous() else inp.contiguous()
        nbytes = src.numel() * src.element_size()
        if output_split_sizes is None and input_split_sizes is None:
            if nbytes % self.world or out.numel() != src.numel():
                raise ValueError(f"all_to_all_single: {src.numel()} input and {out.numel()} output elements "
                                 f"do not split evenly over {self.world} ranks")
            op = self._issue(async_op, self.comm.all_to_all, src.data_ptr(), out.data_ptr(), nbytes // self.world)
            return self._run(op, (out, src, output), back, async_op)
        if math.prod(output.shape[1:]) != math.prod(inp.shape[1:]):
            raise ValueError(f"all_to_all_single: output rows {tuple(output.shape[1:])} differ from input rows "
                             f"{tuple(inp.shape[1:])}")
        sent = _splits(input_split_sizes, inp, self.world, "input")
        got = _splits(output_split_sizes, output, self.world, "output")
        mine = torch.tensor(sent, dtype=torch.int64)
        rows = torch.empty(self.world * self.world, dtype=torch.int64)
        op = self._issue(False, self.comm.all_gather, mine.data_ptr(), rows.data_ptr(), mine.numel() * 8)
        self._run(op, (mine, rows), None, False)
        matrix = rows.tolist()
        received = matrix[self.rank::self.world]
        if received != got:
            raise ValueError(f"all_to_all_single: rank {self.rank} expects {got} rows from the ranks, they send "
                             f"{received}")
        op = self._issue(async_op, self.comm.all_to_all_v, src.data_ptr(), out.data_ptr(), [n * row for n in matrix])
        return self._run(op, (out, src, output), back, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op=False):
        buf, back = _contiguous(tensor)
        op = self._issue(async_op, self.comm.broadcast, buf.data_ptr(), buf.numel() * buf.element_size(),
                         self.group_rank(src))
        return self._run(op, (buf, tensor), back, async_op)

    def scatter(self, tensor: torch.Tensor, chunks, src: int, async_op=False):
        root = self.group_rank(src)
        out, back = _contiguous(tensor)
        nbytes = out.numel() * out.element_size()
        full = None
        if self.rank == root:
            if not chunks or len(chunks) != self.world:
                raise ValueError(f"scatter: the source rank passes {self.world} tensors")
            full = _flat_run(list(chunks))
            if full is None:
                full = torch.cat([c.reshape(-1) for c in chunks])
        op = self._issue(async_op, self.comm.scatter, full.data_ptr() if full is not None else 0, out.data_ptr(),
                         nbytes, root)
        return self._run(op, (out, full, tensor), back, async_op)

    def barrier(self, async_op=False):
        return self._run(self._issue(async_op, self.comm.barrier), None, None, async_op)

    def agree(self, label: str, timeout_s: float = 0.0) -> None:
        """A barrier the ranks pass only under the same ``label`` (31 characters compared): a rank in another
        collective fails at once, naming it (csrc/comm.h, zx_comm_agree); ``timeout_s`` > 0 bounds the wait."""
        self._run(self._issue(False, self.comm.agree, label, timeout_s), None, None, False)

    # --- reductions (callers check reducible() first) ----------------------------------------------

    def reducible(self, dtype: torch.dtype, op) -> bool:
        code = redop_code(op)
        return dtype in _REDUCE_DTYPES and code is not None and (code != 1 or dtype in _FLOATING)

    def all_reduce(self, tensor: torch.Tensor, op, async_op=False):
        buf, back = _contiguous(tensor)
        work = self._issue(async_op, self.comm.all_reduce, buf.data_ptr(), buf.data_ptr(), buf.numel(),
                           _REDUCE_DTYPES[buf.dtype], redop_code(op), 1.0)
        return self._run(work, (buf, tensor), back, async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, op, async_op=False):
        buf, back = _contiguous(tensor)
        root = self.group_rank(dst)
        work = self._issue(async_op, self.comm.reduce, buf.data_ptr(), buf.data_ptr(), buf.numel(),
                           _REDUCE_DTYPES[buf.dtype], redop_code(op), 1.0, root)
        return self._run(work, (buf, tensor), back if self.rank == root else None, async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, inp: torch.Tensor, op, async_op=False):
        if inp.numel() != output.numel() * self.world or inp.dtype != output.dtype:
            raise ValueError(f"reduce_scatter: input has {inp.numel()} {inp.dtype} elements, expected "
                             f"{self.world} x {output.numel()} {output.dtype}")
        out, back = _contiguous(output)
        src = inp if inp.is_contiguous() else inp.contiguous()
        work = self._issue(async_op, self.comm.reduce_scatter, src.data_ptr(), out.data_ptr(), out.numel(),
                           _REDUCE_DTYPES[out.dtype], redop_code(op), 1.0)
        return self._run(work, (out, src, output), back, async_op)

    def reduce_scatter(self, output: torch.Tensor, inputs: List[torch.Tensor], op, async_op=False):
        if len(inputs) != self.world:
            raise ValueError(f"reduce_scatter: {len(inputs)} input tensors for {self.world} ranks")
        flat = _flat_run(list(inputs))
        if flat is None:
            flat = torch.cat([t.reshape(-1) for t in inputs])
        return self.reduce_scatter_tensor(output, flat, op, async_op)

    def destroy(self):
        self.comm.destroy()


# ---------------------------------------------------------------------------------------------------
# One communicator per process group, made on its first collective

_BY_GROUP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> Native | None
_LIVE: List[Native] = []  # destroyed at exit (before the interpreter tears torch down)
# reentrant: a group's finalizer (_forget) takes it, and the collector may run that finalizer on this very
# thread while it holds the lock (any allocation inside for_group), which a plain Lock deadlocks on
_LOCK = threading.RLock()


def host_id() -> str:
    """Ranks with the same id share one /dev/shm."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        shm = os.stat("/dev/shm")
    except OSError:
        return f"!{os.getpid()}"  # no /dev/shm: never equal to another rank's
    return f"{socket.gethostname()}|{boot}|{shm.st_dev}"


def _timeout_s(group) -> float:
    try:  # the process group's own timeout (gloo's options); private, so guarded
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:
        from .process_groups import default_timeout

        return default_timeout().total_seconds()


def _bootstrap(group, ranks) -> Optional[Native]:
    store = dist.distributed_c10d._get_default_store()
    me, n = ranks.index(dist.get_rank()), len(ranks)
    # group names agree across ranks (torch numbers groups in creation order), but a store can outlive
    # a group (torchrun's agent store, a re-initialised world): each communicator made for the name
    # takes the next generation, counted in the store, where every rank adds one
    base = f"zero_ext/comm/{group.group_name}"
    generation = -(-store.add(f"{base}/joins", 1) // n)
    key = f"{base}/{generation}"
    store.set(f"{key}/host/{me}", host_id())
    hosts = {store.get(f"{key}/host/{i}").decode() for i in range(n)}
    if len(hosts) != 1 or next(iter(hosts)).startswith("!"):
        return None
    comm, error = None, ""
    try:
        if me == 0:
            cid = _C.comm_unique_id()
            comm = _C.Comm(cid, 0, n, _timeout_s(group))
            store.set(f"{key}/id", cid)
        else:
            cid = store.get(f"{key}/id").decode()
            if cid.startswith("!"):
                error = cid[1:]
            else:
                comm = _C.Comm(cid, me, n, _timeout_s(group))
    except OSError as e:
        error = e.strerror or str(e)
        if me == 0:
            store.set(f"{key}/id", "!" + error)
    store.set(f"{key}/ok/{me}", "!" + error if error else "ok")
    errors = [store.get(f"{key}/ok/{i}").decode() for i in range(n)]
    failed = [f"rank {ranks[i]}: {e[1:]}" for i, e in enumerate(errors) if e != "ok"]
    if failed:
        if comm is not None:
            comm.destroy()
        logger.warning("zero_ext: native collectives unavailable for group %s (%s); using "
                       "torch.distributed", group.group_name, "; ".join(failed))
        return None
    if me == 0:
        comm.unlink()
    return Native(comm, ranks)


def for_group(group=None) -> Optional[Native]:
    """The native communicator of `group` (None: the default group), made on first use; None where
    torch.distributed carries its collectives."""
    if not dist.is_initialized():
        return None
    group = group or dist.distributed_c10d._get_default_group()
    try:
        return _BY_GROUP[group]
    except KeyError:
        pass
    with _LOCK:
        if group in _BY_GROUP:
            return _BY_GROUP[group]
        native = None
        if mode() == "native" and dist.get_rank(group) >= 0:
            native = _bootstrap(group, dist.get_process_group_ranks(group))
        _BY_GROUP[group] = native
        if native is not None:
            _LIVE.append(native)
            # torch.distributed.destroy_process_group (what scripts call) drops the group: its
            # communicator goes with it rather than living on until exit
            weakref.finalize(group, _forget, native)
        return native


def _forget(native: Native):
    with _LOCK:
        if native in _LIVE:
            _LIVE.remove(native)
    native.destroy()


def existing(group=None) -> Optional[Native]:
    """The native communicator `group` (None: the default group) has already, else None (none is made)."""
    if not dist.is_initialized():
        return None
    return _BY_GROUP.get(group or dist.distributed_c10d._get_default_group())


def transport(group=None) -> str:
    """Which transport carries `group`'s CPU collectives: 'native shared memory' or 'torch.distributed'."""
    return "native shared memory" if for_group(group) is not None else "torch.distributed"


def buffer_bytes() -> int:
    """This rank's share of the shared memory its communicators map (each segment / its ranks, so
    that the ranks' reports add up to what the host holds): the memory report's comm buffers."""
    return sum(n.comm.segment_bytes // n.world for n in _LIVE if not n.comm.destroyed)


def destroy_group(group):
    """Destroys `group`'s communicator, if it has one."""
    with _LOCK:
        native = _BY_GROUP.pop(group, None)
    if native is not None:
        _forget(native)


def destroy_all():
    """Destroys every communicator (waits for their ops): at exit, and when the process group goes."""
    with _LOCK:
        live = list(_LIVE)
        _LIVE.clear()
        _BY_GROUP.clear()
    for native in live:
        native.destroy()


atexit.register(destroy_all)
