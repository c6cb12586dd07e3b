"""zero_ext.nvme.store: groups of CPU tensors (fp32 masters, optimizer states) kept on NVMe.

    store = NVMeStateStore("/local_nvme", buffer_count=4)
    store.register(i, [master, exp_avg, exp_avg_sq])        # written out; their storage is released
    for i in store.stream(range(n), pipeline_read=True, pipeline_write=True):
        optimizer_step(i)                                    # group i's tensors are in memory here
    with store.resident(i) as (master, exp_avg, exp_avg_sq):
        ...                                                  # random access: state routines, checkpoints
    store.begin() ... store.commit() / store.rollback()      # all or nothing (groups with a spare file)

What it owns: the swap files of each group (one, or two with a spare: groups.py), a pool
of ``buffer_count`` page-aligned host buffers, and each group's ``SwapState``. What it does not do:
decide which tensors form a group, run the optimizer, or know about the engine's config (the
engine passes ``buffer_count``, ``pin_memory`` and the ``aio`` section).

[Note: tensor identity under NVMe offload] The tensors a caller registers stay the same Python
objects for the whole run: ``optimizer.state[master]`` is keyed by the master, and the engine, the
state routines and checkpoints hold references to it. Swapping moves only the storage: swapped out,
``t.data`` is an empty tensor of ``t``'s dtype; swapped in, ``t.data`` is a view of a pool buffer
with ``t``'s shape. Code that touches a group's tensors outside ``resident``/``stream`` sees zero
elements (and fails loudly on shape checks) rather than stale numbers.

[Note: group layout] A group is one file holding its tensors back to back, each starting at a
multiple of 64 bytes (a cache line, the widest SIMD load), the whole rounded up to 4096 bytes
(O_DIRECT). One read or write request moves a whole group; aio cuts it into ``block_size`` blocks
and keeps ``queue_depth`` of them in flight, so a group of a few MiB already streams at full speed.

[Note: buffer reuse] A buffer is taken by a group when its read starts and stays that group's after
the write-back finishes, as a clean copy: a group read again before its buffer is needed by another
needs no I/O. A buffer whose write is still in flight is reused only after that write finished,
and one holding a group in use (read in flight, resident) is never taken: when every buffer is in
use, taking one is an error naming ``offload_optimizer.buffer_count``.

Not thread-safe: one thread drives a store (the optimizer step's).
"""
from __future__ import annotations

import contextlib
import errno
import logging
from typing import Dict, Hashable, Iterable, Iterator, List, Optional, Sequence, Union

import torch

from .aio import ALIGN, AioError, AsyncIO, PathLike, aligned_empty, round_up
from .groups import PoolBuffer, SwapGroup, SwapState, group_views, pack_layout, zero_gaps
from .swapper import NVMeSwapper

logger = logging.getLogger("zero_ext.nvme_states")

LP_CHUNK = 1 << 22  # elements converted per copy in register_from_lp (bounds a device temporary)
BUFFER_COUNT_KEY = "offload_optimizer.buffer_count"


class NVMeStateStore:
    """Groups of CPU tensors kept in swap files under ``nvme_path``, swapped in through a pool of
    ``buffer_count`` host buffers, each as large as the largest group.

    ``aio``: an ``AsyncIO``, the ``aio`` config section as a dict, or None for its defaults.
    ``pin_memory``: the pool is CUDA page-locked when CUDA is available (host-to-device copies of
    resident tensors can then be asynchronous); otherwise it is on transparent huge pages.
    ``max_group_bytes``: allocate the pool at once for groups up to this size (``group_nbytes``
    computes it); None grows the pool as larger groups are registered (only while no group is in
    use, so never during a step).
    ``spare_slot``: two files per group (the default of ``register``), the second reserved at
    ``register``, so that a failed write-back never destroys a group's last good data and
    ``begin``/``commit``/``rollback`` make a set of write-backs all-or-nothing ([Note: spare slots]
    in groups.py; twice the space on NVMe).
    """

    def __init__(self, nvme_path: PathLike, buffer_count: int = 4, *,
                 aio: Union[AsyncIO, dict, None] = None, pin_memory: bool = True,
                 max_group_bytes: Optional[int] = None, spare_slot: bool = False):
        if not isinstance(buffer_count, int) or isinstance(buffer_count, bool) or buffer_count < 1:
            raise ValueError(f"{BUFFER_COUNT_KEY} must be an int >= 1 for NVMe offload, not "
                             f"{buffer_count!r}")
        self.buffer_count = buffer_count
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.swapper = NVMeSwapper(nvme_path, aio)
        self.aio = self.swapper.aio
        self._groups: Dict[Hashable, SwapGroup] = {}
        self._by_tensor: Dict[int, Hashable] = {}  # id(tensor) -> key: a tensor belongs to one group
        self._buffers: List[PoolBuffer] = []
        self._buffer_bytes = 0
        self._fixed_size = max_group_bytes is not None
        self._clock = 0  # for least-recently-used choice among clean buffers
        self._files_made = 0
        self._destroyed = False
        self._held: set = set()  # groups in_memory() holds in ordinary memory
        self.spare_slot = bool(spare_slot)
        self._txn: Optional[Dict[Hashable, SwapGroup]] = None  # groups written in the open transaction
        if max_group_bytes is not None:
            self._allocate_pool(max_group_bytes)

    # -- sizes ---------------------------------------------------------------------------------------

    @staticmethod
    def group_nbytes(specs: Iterable[Union[torch.Tensor, Tuple[Sequence[int], torch.dtype]]]) -> int:
        """Buffer bytes a group needs: ``specs`` are its tensors, or (shape, dtype) pairs."""
        pairs = [(s.shape, s.dtype) if isinstance(s, torch.Tensor) else (torch.Size(s[0]), s[1])
                 for s in specs]
        return pack_layout(pairs)[1]

    def nvme_bytes(self) -> int:
        """Bytes held in this store's swap files (both slots of each group with ``spare_slot``)."""
        return sum(round_up(g.nbytes) * len(g.names) for g in self._groups.values())

    def host_bytes(self) -> int:
        """Bytes of the host buffer pool (the only host memory this store holds)."""
        return sum(b.data.numel() for b in self._buffers)

    def keys(self) -> List[Hashable]:
        return list(self._groups)

    def tensors(self, key) -> List[torch.Tensor]:
        """Group ``key``'s tensors, the objects registered (empty unless resident)."""
        return list(self._group(key).tensors)

    def state(self, key) -> SwapState:
        return self._group(key).state

    def __contains__(self, key) -> bool:
        return key in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    # -- registration --------------------------------------------------------------------------------

    def register(self, key: Hashable, tensors: Sequence[torch.Tensor], spare_slot: Optional[bool] = None) -> None:
        """Writes ``tensors`` (CPU tensors of any dtype and shape) as group ``key``, then releases
        their storage; the objects stay valid and become resident again in ``resident``/``stream``.
        Synchronous: if the write fails (AioError, e.g. a full drive) the tensors are left as they
        were and ``key`` is not registered. ``spare_slot``: whether the group has a spare file
        (default: the store's)."""
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"register({key!r}): item {i} is a {type(t).__name__}, not a tensor")
            if t.device.type != "cpu":
                raise ValueError(f"register({key!r}): tensor {i} is on {t.device}; NVMe offload "
                                 "keeps CPU tensors (copy it to the CPU first)")
        group = self._new_group(key, tensors, [(t.shape, t.dtype) for t in tensors], spare_slot)
        views = group_views(group.buffer.data, group.layout)
        zero_gaps(group.buffer.data, group.layout)
        with torch.no_grad():
            for view, t in zip(views, tensors):
                view.copy_(t)
        self._write_new_group(group)

    def register_from_lp(self, key: Hashable, lp_tensors: Sequence[torch.Tensor],
                         extra_zero_tensors_numels: Sequence[Union[int, Sequence[int]]],
                         dtype: torch.dtype = torch.float32) -> List[torch.Tensor]:
        """fast_init: builds group ``key`` from low-precision tensors without making fp32 copies
        in memory. The group is one ``dtype`` master per ``lp_tensors`` item (its shape, values
        converted as ``lp.to(dtype)``) followed by zero tensors of ``extra_zero_tensors_numels``
        (numels or shapes: the optimizer state). Conversion goes chunk by chunk straight into a
        pool buffer, which is then written. Returns the group's new tensors, released (empty):
        the masters and the states, in that order. ``lp_tensors`` may be on any device."""
        shapes = [lp.shape for lp in lp_tensors]
        shapes += [torch.Size((n,) if isinstance(n, int) else n) for n in extra_zero_tensors_numels]
        tensors = [torch.empty(0, dtype=dtype) for _ in shapes]
        group = self._new_group(key, tensors, [(s, dtype) for s in shapes])
        views = group_views(group.buffer.data, group.layout)
        zero_gaps(group.buffer.data, group.layout)
        with torch.no_grad():
            for view, lp in zip(views, lp_tensors):
                flat_out, flat_in = view.view(-1), lp.detach().reshape(-1)
                for start in range(0, flat_in.numel(), LP_CHUNK):
                    flat_out[start:start + LP_CHUNK].copy_(flat_in[start:start + LP_CHUNK])
            for view in views[len(lp_tensors):]:
                view.zero_()
        self._write_new_group(group)
        return list(tensors)

    def _new_group(self, key, tensors, specs, spare_slot: Optional[bool] = None) -> SwapGroup:
        """Checks, sizes the pool, and gives the new group a buffer (not yet in self._groups)."""
        self._check_alive()
        if key in self._groups:
            raise ValueError(f"group {key!r} is already registered in this NVMe store")
        seen = set()
        for i, t in enumerate(tensors):
            if id(t) in seen or id(t) in self._by_tensor:
                owner = self._by_tensor.get(id(t), key)
                raise ValueError(f"register({key!r}): tensor {i} is already in group {owner!r}; "
                                 "a tensor can belong to one group once")
            seen.add(id(t))
        layout, nbytes = pack_layout(specs)
        self._ensure_pool(nbytes, key)
        self._files_made += 1  # file names never repeat, even after a failed register
        spare = self.spare_slot if spare_slot is None else bool(spare_slot)
        names = [f"group{self._files_made:05d}.swp"] + [f"group{self._files_made:05d}.spare.swp"] * spare
        group = SwapGroup(key, names, tensors, layout, nbytes)
        self._take_buffer(group)
        return group

    def _write_new_group(self, group: SwapGroup) -> None:
        buf = group.buffer
        try:
            self.swapper.swap_out(group.names[0], buf.data[:group.nbytes]).wait()
            if len(group.names) == 2:  # reserved now: a drive too small for both fails here, not in a step
                self.swapper.reserve(group.names[1], group.nbytes)
        except BaseException:
            buf.group, group.buffer = None, None
            for name in group.names:
                with contextlib.suppress(OSError):
                    self.swapper.remove(name)
            raise
        self._groups[group.key] = group
        for t in group.tensors:
            self._by_tensor[id(t)] = group.key
            t.data = torch.empty(0, dtype=t.dtype)
        self._touch(group)  # state ON_NVME, buffer kept as a clean copy

    # -- the buffer pool -----------------------------------------------------------------------------

    def _allocate_pool(self, nbytes: int) -> None:
        size = max(round_up(nbytes), ALIGN)
        if self._buffers:  # no I/O on them is in flight (see _ensure_pool)
            self.aio.unregister_buffers([b.data for b in self._buffers])
        self._buffers = [PoolBuffer(aligned_empty(size, torch.uint8, pin_memory=self.pin_memory))
                         for _ in range(self.buffer_count)]
        self._buffer_bytes = size
        # io_uring fixed buffers: the pool's pages are pinned once, not on every request
        self.aio.register_buffers([b.data for b in self._buffers])

    def _ensure_pool(self, nbytes: int, key) -> None:
        if self._buffers and nbytes <= self._buffer_bytes:
            return
        if self._fixed_size:
            raise ValueError(f"group {key!r} needs {nbytes} buffer bytes; the pool was made for "
                             f"max_group_bytes={self._buffer_bytes}")
        busy = [b.group.key for b in self._buffers if b.group and b.group.state != SwapState.ON_NVME]
        if busy:
            raise RuntimeError(f"group {key!r} needs larger swap buffers ({nbytes} bytes), which "
                               f"cannot be reallocated while groups {busy} are in use: register "
                               "groups before stepping, or pass max_group_bytes")
        for b in self._buffers:
            if b.group is not None:
                b.group.buffer = None
        self._allocate_pool(nbytes)

    def _touch(self, group: SwapGroup) -> None:
        self._clock += 1
        group.last_use = self._clock

    def _take_buffer(self, group: SwapGroup) -> bool:
        """Gives ``group`` a buffer; True when that buffer already holds its data (no read needed).
        See [Note: buffer reuse]."""
        if group.buffer is not None:
            return True
        free = [b for b in self._buffers if b.group is None]
        if not free:
            clean = [b for b in self._buffers if b.group.state == SwapState.ON_NVME]
            if not clean:
                writing = [b for b in self._buffers if b.group.state == SwapState.SWAPPING_OUT]
                if not writing:
                    raise RuntimeError(
                        f"NVMe offload needs a swap buffer for group {group.key!r} but all "
                        f"{self.buffer_count} are held by groups in use "
                        f"({[b.group.key for b in self._buffers]}); raise {BUFFER_COUNT_KEY}")
                oldest = min(writing, key=lambda b: b.group.request.op)
                self._finish_write(oldest.group)  # raises if it failed (the group is then invalid)
                clean = [oldest]
            victim = min(clean, key=lambda b: b.group.last_use)
            self._drop_buffer(victim.group)
            free = [victim]
        buf = free[0]
        buf.group, group.buffer = group, buf
        return False

    def unregister(self, key: Hashable) -> None:
        """Forgets group ``key`` and removes its swap file (its tensors are left as they are: released).
        The group must not be in use (resident or streaming)."""
        group = self._group(key)
        self._settle([group], raise_errors=False)
        if group.state not in (SwapState.ON_NVME, SwapState.INVALID):
            raise RuntimeError(f"group {key!r} is in use ({group.state.value}); it cannot be unregistered")
        self._drop_buffer(group)
        for t in group.tensors:
            self._by_tensor.pop(id(t), None)
        del self._groups[key]
        for name in group.names:
            self.swapper.remove(name)

    def _drop_buffer(self, group: SwapGroup) -> None:
        if group.buffer is not None:
            group.buffer.group = None
            group.buffer = None

    # -- group transitions ---------------------------------------------------------------------------

    def _group(self, key) -> SwapGroup:
        self._check_alive()
        group = self._groups.get(key)
        if group is None:
            raise KeyError(f"no group {key!r} was registered in this NVMe store (nothing was "
                           "written for it, so there is nothing to read)")
        return group

    def _start_read(self, group: SwapGroup) -> None:
        """ON_NVME -> SWAPPING_IN (read submitted, or none needed); no-op if already on its way in."""
        if group.state == SwapState.SWAPPING_OUT:
            self._finish_write(group)  # the buffer then still holds the data: no read needed
        if group.state == SwapState.INVALID:
            err = group.error
            why = err.strerror if err.errno == errno.EINVAL else f"its last write failed ({err})"
            raise AioError(err.errno, f"group {group.key!r} has no valid data on NVMe: {why}",
                           err.filename)
        if group.state != SwapState.ON_NVME:
            return
        if not self._take_buffer(group):
            try:
                group.request = self.swapper.swap_in(group.name, group.buffer.data[:group.nbytes])
            except BaseException:
                self._drop_buffer(group)  # else the buffer would pass for a clean copy
                raise
        group.state = SwapState.SWAPPING_IN

    def _finish_read(self, group: SwapGroup) -> None:
        """SWAPPING_IN -> IN_MEMORY (tensors point into the buffer); adds a hold."""
        if group.state == SwapState.SWAPPING_IN:
            req, group.request = group.request, None
            if req is not None:
                try:
                    with torch.autograd.profiler.record_function(f"zero_ext::nvme_swap_in ({group.key})"):
                        req.wait()
                except BaseException:
                    self._drop_buffer(group)
                    group.state = SwapState.ON_NVME
                    raise
            for t, view in zip(group.tensors, group_views(group.buffer.data, group.layout)):
                t.data = view
            group.state = SwapState.IN_MEMORY
        group.holds += 1
        self._touch(group)

    def _release(self, group: SwapGroup, modified: bool) -> None:
        """Drops a hold; the last one starts the write-back (IN_MEMORY -> SWAPPING_OUT) or, when
        not modified, goes straight to ON_NVME. Tensors are released either way."""
        group.holds -= 1
        if group.holds > 0:
            return
        if modified:
            views = group_views(group.buffer.data, group.layout)
            for i, (t, view) in enumerate(zip(group.tensors, views)):
                if t.data_ptr() != view.data_ptr() or t.shape != view.shape:
                    self._release_tensors(group)
                    self._drop_buffer(group)
                    group.state, group.error = SwapState.INVALID, AioError(
                        errno.EINVAL, f"tensor {i} was given new storage while resident, so the "
                        "update was not written back", self.swapper.dir.file(group.name))
                    raise ValueError(f"tensor {i} of NVMe group {group.key!r} was given new storage "
                                     "(t.data = ..., set_, resize_) while resident; update resident "
                                     "tensors in place. The group is now invalid.")
        self._release_tensors(group)
        if not modified:
            group.state = SwapState.ON_NVME
            self._drop_buffer(group)  # it may differ from the file if the caller broke the promise
            return
        group.writing = 1 - group.valid if len(group.names) == 2 else 0
        if self._txn is not None:
            self._txn[group.key] = group
        try:
            group.request = self.swapper.swap_out(group.names[group.writing], group.buffer.data[:group.nbytes])
        except AioError as exc:
            self._drop_buffer(group)
            group.state, group.error = SwapState.INVALID, exc
            raise
        group.state = SwapState.SWAPPING_OUT

    def _finish_write(self, group: SwapGroup) -> None:
        """SWAPPING_OUT -> ON_NVME (buffer kept as a clean copy), or INVALID (raises) on failure."""
        if group.state != SwapState.SWAPPING_OUT:
            return
        req, group.request = group.request, None
        try:
            with torch.autograd.profiler.record_function(f"zero_ext::nvme_swap_out ({group.key})"):
                req.wait()
        except AioError as exc:
            self._drop_buffer(group)
            group.state, group.error = SwapState.INVALID, exc
            raise
        group.state, group.newest = SwapState.ON_NVME, group.writing
        if self._txn is None:
            group.valid = group.writing

    @staticmethod
    def _release_tensors(group: SwapGroup) -> None:
        for t in group.tensors:
            t.data = torch.empty(0, dtype=t.dtype)

    def _settle(self, groups: Iterable[SwapGroup], raise_errors: bool, quiet: bool = False) -> None:
        """Waits for every read and write of ``groups`` in flight; a read nobody will use leaves
        its data in the buffer as a clean copy. Raises the first write error if asked (it is
        recorded in the group either way)."""
        first = None
        for group in groups:
            if group.state == SwapState.SWAPPING_IN:
                req, group.request = group.request, None
                try:
                    if req is not None:
                        req.wait()
                except AioError:
                    self._drop_buffer(group)
                group.state = SwapState.ON_NVME
            elif group.state == SwapState.SWAPPING_OUT:
                try:
                    self._finish_write(group)
                except AioError as exc:
                    first = first or exc
                    if not raise_errors and not quiet:
                        logger.warning("write-back of NVMe group %r failed while another error was "
                                       "raised; the group is invalid: %s", group.key, exc)
        if first is not None and raise_errors:
            raise first

    # -- transactions ([Note: spare slots]) -------------------------------------------------------------

    def begin(self) -> None:
        """Opens a transaction: from now on a written group's new data goes to its spare file and is
        read from there, while its last committed data stays where it was until ``commit``."""
        self._check_alive()
        if self._txn is not None:
            raise RuntimeError("an NVMe store transaction is already open")
        self._txn = {}

    def commit(self) -> None:
        """Makes every write of the open transaction the groups' good data. Every write must have
        finished and succeeded (the caller's loop ended normally; ``stream`` waits for its writes)."""
        groups, self._txn = self._txn or {}, None
        bad = [g.key for g in groups.values() if g.state != SwapState.ON_NVME]
        if bad:  # (a caller's bug: nothing is committed, and the transaction is rolled back)
            self._txn = groups
            self.rollback()
            raise RuntimeError(f"commit of NVMe groups {bad} that are in use or whose write failed; rolled back")
        for group in groups.values():
            group.valid = group.newest

    def rollback(self) -> None:
        """Forgets every write of the open transaction: I/O in flight is waited for (its errors are
        part of what is forgotten), the buffers holding new data are dropped, and each group is again
        its last committed data (a group whose write failed included). Groups still in use (resident)
        are an error: close the loops and ``resident`` blocks first. A group without a spare file was
        written in place: it becomes INVALID (its last good data is gone)."""
        groups = self._txn or {}
        self._settle(list(groups.values()), raise_errors=False, quiet=True)
        busy = [g.key for g in groups.values() if g.holds > 0]
        if busy:
            raise RuntimeError(f"rollback of NVMe groups {busy} that are still resident")
        self._txn = None
        for group in groups.values():
            self._drop_buffer(group)
            group.state, group.error, group.newest = SwapState.ON_NVME, None, group.valid
            if len(group.names) == 1:
                group.state, group.error = SwapState.INVALID, AioError(
                    errno.EINVAL, "it was written in place in a transaction that was rolled back",
                    self.swapper.dir.file(group.name))

    @property
    def in_transaction(self) -> bool:
        return self._txn is not None

    def transaction_keys(self) -> List[Hashable]:
        """The groups written in the open transaction so far (none when no transaction is open)."""
        return list(self._txn or ())

    # -- access --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def resident(self, key: Hashable, modified: bool = True) -> Iterator[List[torch.Tensor]]:
        """Group ``key`` in memory for the ``with`` block (yields its tensors); on exit it is
        written back (and waited for) unless ``modified=False`` promises it was only read. Nested
        uses of one group (also inside ``stream``) share it; the outermost exit writes it. A group
        ``in_memory`` holds is shared too (no I/O)."""
        group = self._group(key)
        if key in self._held:
            yield list(group.tensors)
            return
        self._start_read(group)
        self._finish_read(group)
        ok = False
        try:
            yield list(group.tensors)
            ok = True
        finally:
            self._release(group, modified)
            if group.holds == 0:
                self._settle([group], raise_errors=ok)

    @contextlib.contextmanager
    def in_memory(self, keys: Iterable[Hashable], modified: bool = True) -> Iterator[None]:
        """Groups ``keys`` in ordinary host memory (fresh tensors, not the pool) for the ``with`` block,
        all at once: random access to more groups than there are buffers (checkpoints, state routines).
        Their tensors may be written, and may be given new storage of the same shape; after the block
        the groups are written back (unless ``modified=False``) and released. Inside, ``resident`` of
        these groups shares them; do not ``stream`` them."""
        keys = [k for k in keys if k not in self._held]
        try:
            for k in keys:
                with self.resident(k, modified=False) as tensors:
                    copies = [t.detach().clone() for t in tensors]
                for t, c in zip(self._group(k).tensors, copies):
                    t.data = c
                self._held.add(k)
            yield
        finally:
            for k in keys:
                if k not in self._held:
                    continue
                self._held.discard(k)
                group = self._group(k)
                values = [t.data for t in group.tensors]
                self._release_tensors(group)
                if modified:
                    with self.resident(k, modified=True) as tensors:
                        for t, v in zip(tensors, values):
                            t.copy_(v.reshape(t.shape))

    def stream(self, keys: Iterable[Hashable], pipeline_read: bool = False,
               pipeline_write: bool = False) -> Iterator[Hashable]:
        """Yields each key of ``keys`` with that group resident, writing it back after the body
        (every group is assumed modified). ``pipeline_read``: the next group's read is submitted
        before the current group is yielded. ``pipeline_write``: the current group's write-back
        runs while the next is read and used. Without either: read, yield, write, one group at a
        time. Needs 2 buffers with one of them, 3 with both (never more than there are groups:
        each buffer in use holds a different group). All I/O has finished, and any write error been
        raised, when the loop ends; if the loop is left early (break, exception), the group in hand
        is written back and I/O in flight is waited for when the generator closes."""
        groups = [self._group(k) for k in keys]  # unknown keys fail before any I/O
        need = min(1 + bool(pipeline_read) + bool(pipeline_write), max(1, len(groups)))
        if self.buffer_count < need:
            what = " and ".join(n for n, on in (("pipeline_read", pipeline_read),
                                                ("pipeline_write", pipeline_write)) if on)
            raise ValueError(f"{what} need{'s' if need == 2 else ''} {BUFFER_COUNT_KEY} >= {need} "
                             f"(one buffer for the group being stepped, one for the next group's "
                             f"read, one for the previous group's write); it is {self.buffer_count}")
        return self._stream(groups, bool(pipeline_read), bool(pipeline_write))

    def _stream(self, groups: List[SwapGroup], pipeline_read: bool, pipeline_write: bool):
        ok = False  # raise write errors at the end of the loop or on close(), not over another error
        try:
            for i, group in enumerate(groups):
                self._start_read(group)  # no-op when it was prefetched
                if pipeline_read and i + 1 < len(groups):
                    self._start_read(groups[i + 1])
                self._finish_read(group)
                try:
                    yield group.key
                except GeneratorExit:  # the loop was left early: nothing else is being raised
                    ok = True
                    raise
                finally:
                    self._release(group, modified=True)
                if not pipeline_write:
                    self._finish_write(group)
            ok = True
        finally:
            self._settle(groups, raise_errors=ok)

    # -- lifetime ------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this NVMe state store was destroyed")

    def destroy(self) -> None:
        """Waits for I/O in flight, releases every group's tensors, frees the pool and removes the
        swap files and directory. Idempotent. Dropping the store (or exiting) removes the files
        too, through the swap directory's finalizer."""
        if self._destroyed:
            return
        self._destroyed = True
        self._settle(self._groups.values(), raise_errors=False)
        for group in self._groups.values():
            self._release_tensors(group)
            group.buffer, group.state = None, SwapState.INVALID
        if not self.aio.closed:
            self.aio.unregister_buffers([b.data for b in self._buffers])
        self._buffers.clear()
        self._by_tensor.clear()
        self.swapper.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __repr__(self):
        return (f"NVMeStateStore({self.swapper.dir.path!r}, groups={len(self._groups)}, "
                f"buffer_count={self.buffer_count}, buffer_bytes={self._buffer_bytes}"
                f"{', destroyed' if self._destroyed else ''})")


__all__ = ["NVMeStateStore", "SwapState"]
