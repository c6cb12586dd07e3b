"""zero_ext.nvme.aio: asynchronous swapping of CPU tensors to files on NVMe, over ``_C.AioHandle``.

    aio = AsyncIO(block_size=1 << 20, queue_depth=32)      # or AsyncIO.from_config(config.aio)
    buf = aligned_empty(n, torch.float32)                  # page-aligned: O_DIRECT needs it
    f = aio.open("/nvme/run/x.swp", create=True)
    req = aio.submit_write(buf, f)                         # returns at once; the GIL is free
    ...
    req.wait()                                             # or aio.wait() for every request

Layers, bottom up:
- ``AsyncIO``: one C handle (io_uring workers, or the pread/pwrite thread pool where the kernel
  refuses io_uring; ``ZERO_EXT_AIO=uring|threads`` forces one) with the ``aio`` config section's
  settings. Reads and writes byte ranges of files; checks buffers (CPU, contiguous, page-aligned for
  O_DIRECT); turns a failed request into an :class:`AioError` that names the file, offset, size and
  errno text. Also answers DeepSpeed's ``aio_handle`` calls (``async_pwrite``, ``wait``, ...).
- ``SwapDir`` and ``check_nvme_path`` (swap_dir.py): the per-run directory under ``nvme_path``, and
  the check the engine makes at initialize, before any training step.
- ``NVMeSwapper`` (swapper.py): whole tensors swapped by name into a ``SwapDir``.

[Note: files without O_DIRECT] Files are opened with O_DIRECT (the page cache would hold a second
copy of every swapped byte). A file system that refuses it (ramfs, tmpfs before Linux 6.6, some
FUSE) gets buffered I/O instead, with one warning per file system. The file layout is the same
either way: offsets are multiples of 4096 and a write of n bytes writes n rounded up to 4096 (the
tail zero-filled), so a file written one way reads back the other.
"""
from __future__ import annotations

import errno
import logging
import os
import weakref
from typing import Dict, Optional, Union

import torch

from pydantic import ValidationError

from .. import _C
from ..config.aio import AioConfig
from ..config.errors import ConfigError
from ..config.keys import Report, walk
from ..config.messages import problems_from_errors
from ..offload.host_buffers import ALIGN, HUGE_PAGE, aligned_empty, host_empty, is_aligned  # noqa: F401 (the API)

logger = logging.getLogger("zero_ext.aio")

BACKENDS = ("uring", "threads")
ENV = "ZERO_EXT_AIO"

PathLike = Union[str, os.PathLike]


class AioError(OSError):
    """A failed swap I/O: ``errno``, ``filename`` and a message naming the offset and size."""


def round_up(nbytes: int) -> int:
    """Bytes a write of ``nbytes`` puts in the file (and the file must hold for a whole-file read)."""
    return -(-nbytes // ALIGN) * ALIGN


# ---------------------------------------------------------------------------------------------------
# Backend choice

_probe_errno: Optional[int] = None
_said = set()  # one-time warnings already given


def _once(key, msg, *args):
    if key not in _said:
        _said.add(key)
        logger.warning(msg, *args)


def uring_errno() -> int:
    """0 when this process may use io_uring, else the kernel's errno (probed once, then cached)."""
    global _probe_errno
    if _probe_errno is None:
        _probe_errno = _C.aio_uring_probe()
    return _probe_errno


def choose_backend(backend: Optional[str] = None) -> str:
    """The backend a new AsyncIO runs: ``backend``, else $ZERO_EXT_AIO, else io_uring where the
    kernel allows it and the thread pool where it does not (logged once)."""
    source = "backend"
    if backend is None and os.environ.get(ENV, "").strip():
        backend, source = os.environ[ENV].strip().lower(), ENV
    if backend is None or backend == "auto":
        err = uring_errno()
        if not err:
            return "uring"
        _once("uring", "io_uring is refused by this kernel (%s: %s); NVMe swapping uses the "
              "pread/pwrite thread pool instead (set %s=threads to choose it explicitly)",
              errno.errorcode.get(err, err), os.strerror(err), ENV)
        return "threads"
    if backend not in BACKENDS:
        raise ValueError(f"{source}={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "uring" and uring_errno():
        err = uring_errno()
        raise AioError(err, f"{source}=uring but this kernel refuses io_uring ({os.strerror(err)}); "
                       f"use {ENV}=threads (or unset it to fall back automatically)")
    return backend


# ---------------------------------------------------------------------------------------------------
# Buffers and files

def _direct_refused(path: str, exc: OSError) -> None:
    try:
        dev = os.stat(os.path.dirname(os.path.abspath(path))).st_dev
    except OSError:
        dev = path
    _once(("direct", dev), "the file system of %s refuses O_DIRECT (%s); swap files there use "
          "buffered I/O, which also fills the page cache", os.path.dirname(os.path.abspath(path)),
          exc.strerror)


class SwapFile:
    """An open file for AsyncIO. O_DIRECT where the file system allows it (``direct`` says)."""

    def __init__(self, path: PathLike, *, write: bool = True, create: bool = False):
        self.path = os.fspath(path)
        flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        try:
            try:
                self.fd, self.direct = os.open(self.path, flags | os.O_DIRECT, 0o600), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                _direct_refused(self.path, exc)
                self.fd, self.direct = os.open(self.path, flags, 0o600), False
        except OSError as exc:
            what = "create" if create else "open"
            raise AioError(exc.errno, f"cannot {what} swap file {self.path} for "
                           f"{'writing' if write else 'reading'}: {exc.strerror}", self.path) from None
        self.writable = write
        self._finalizer = weakref.finalize(self, os.close, self.fd)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Closes the descriptor; requests already submitted keep their own and finish."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"SwapFile({self.path!r}, direct={self.direct}{', closed' if self.closed else ''})"


def free_bytes(path: str) -> Optional[int]:
    """Bytes free for this user on path's file system; None when unknown (a file system without a size
    limit, such as ramfs, reports 0 blocks in all and 0 free)."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)) if not os.path.isdir(path) else path)
    except OSError:
        return None
    if st.f_blocks == 0:
        return None
    return st.f_bavail * st.f_frsize


def _op_error(kind: str, path: str, offset: int, nbytes: int, res) -> AioError:
    """The exception for a failed op: res is _C's (errno, short, offset, length, done)."""
    err, short, roff, rlen, rdone = res
    what = f"{kind} of {nbytes} bytes at offset {offset} of {path}"
    request = f"request of {rlen} bytes at offset {roff} moved {rdone}"
    if err == errno.ECANCELED:
        return AioError(err, f"{what} was cancelled: the AsyncIO was closed before it ran", path)
    if kind == "read" and short:
        try:
            size = f"{os.stat(path).st_size} bytes"
        except OSError:
            size = "an unknown size"
        return AioError(errno.EIO, f"short read: {what} ({request}): the file holds {size}, "
                        f"{offset + nbytes} needed; it is not the file this data was written to",
                        path)
    if kind == "write" and (err in (errno.ENOSPC, errno.EDQUOT) or short):
        free = free_bytes(path)
        need = round_up(nbytes)
        if err != errno.EDQUOT and (err == errno.ENOSPC or (free is not None and free < need)):
            err = errno.ENOSPC
        tail = f"{need} bytes needed, {'?' if free is None else free} bytes free on its file system"
        lead = "short write: " if short else ""
        return AioError(err, f"{lead}{what}: {os.strerror(err)} ({tail}; {request}); free space "
                        "under nvme_path or point it to a larger drive", path)
    if err == errno.EFBIG:
        return AioError(err, f"{what}: {os.strerror(err)} ({request}); the process's file size "
                        "limit (ulimit -f, RLIMIT_FSIZE) or the file system's limit is exceeded", path)
    return AioError(err, f"{what}: {os.strerror(err)} ({request})", path)


# ---------------------------------------------------------------------------------------------------
# AsyncIO

class AioRequest:
    """One submitted read or write. ``wait()`` blocks (GIL released) and raises AioError on failure."""

    def __init__(self, aio: "AsyncIO", op: int, kind: str, path: str, offset: int, nbytes: int):
        self._aio, self.op, self.kind = aio, op, kind
        self.path, self.offset, self.nbytes = path, offset, nbytes
        self.finished = False
        self.error: Optional[AioError] = None

    def done(self) -> bool:
        """Whether the request has finished (wait() will not block)."""
        return self.finished or self._aio._handle.done(self.op)

    def wait(self) -> None:
        if not self.finished:
            self._aio._wait_one(self)
        if self.error is not None:
            raise self.error

    def __repr__(self):
        state = "failed" if self.error else "finished" if self.finished else "pending"
        return f"<AioRequest {self.kind} {self.nbytes} B @ {self.offset} of {self.path} ({state})>"


class AsyncIO:
    """Asynchronous reads and writes of CPU tensors, with the ``aio`` section's settings
    (DeepSpeed's keys and defaults). ``thread_count`` is an alias of ``intra_op_parallelism``;
    ``use_gds`` is accepted and reported as unsupported. ``backend``: "uring", "threads", or None
    for $ZERO_EXT_AIO / automatic. Close it (or use ``with``); dropping it does the same."""

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, intra_op_parallelism: int = 1,
                 single_submit: bool = False, overlap_events: bool = True, use_gds: bool = False,
                 backend: Optional[str] = None, *, thread_count: Optional[int] = None):
        if thread_count is not None:
            intra_op_parallelism = thread_count
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("intra_op_parallelism", intra_op_parallelism)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"aio.{name} must be a positive int, not {value!r}")
        if block_size % ALIGN:
            raise ValueError(f"aio.block_size must be a multiple of {ALIGN} (O_DIRECT), "
                             f"not {block_size}")
        if use_gds:
            _once("gds", "aio.use_gds: GPUDirect Storage is not supported by zero_ext; swapping "
                  "goes through host memory")
        self.block_size, self.queue_depth = block_size, queue_depth
        self.intra_op_parallelism = intra_op_parallelism
        self.single_submit, self.overlap_events = bool(single_submit), bool(overlap_events)
        self.use_gds = False
        self._handle = _C.AioHandle(block_size, queue_depth, intra_op_parallelism,
                                    self.single_submit, self.overlap_events, choose_backend(backend))
        self.backend: str = self._handle.backend
        self._requests: Dict[int, AioRequest] = {}
        self._pid = os.getpid()
        self._registered: Dict[int, torch.Tensor] = {}  # data_ptr -> tensor, see register_buffers

    @classmethod
    def from_config(cls, config=None, backend: Optional[str] = None) -> "AsyncIO":
        """From an ``AioConfig`` (zero_ext.config), a dict of the section as in a DeepSpeed config
        (aliases such as ``thread_count`` and "auto" values accepted), or None for the defaults."""
        if config is None or isinstance(config, dict):
            report = Report()
            data = walk(dict(config or {}), AioConfig, "aio", report)
            if report.problems:
                raise ConfigError(report.problems)
            try:
                config = AioConfig(**data)
            except ValidationError as err:
                raise ConfigError(problems_from_errors(err.errors(), prefix="aio")) from None
        return cls(config.block_size, config.queue_depth, config.intra_op_parallelism,
                   config.single_submit, config.overlap_events, config.use_gds, backend)

    # -- reads and writes ---------------------------------------------------------------------------

    def open(self, path: PathLike, *, write: bool = True, create: bool = False) -> SwapFile:
        return SwapFile(path, write=write, create=create)

    def _check(self, buffer: torch.Tensor, file: SwapFile, offset: int, kind: str) -> int:
        if os.getpid() != self._pid:
            raise RuntimeError("an AsyncIO cannot be used in a forked child; create one there")
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"{kind} buffer must be a torch.Tensor, not {type(buffer).__name__}")
        if buffer.device.type != "cpu":
            raise ValueError(f"{kind} buffer is on {buffer.device}; swap I/O needs a CPU tensor "
                             "(copy it to a page-aligned host buffer first: aligned_empty)")
        if not buffer.is_contiguous():
            raise ValueError(f"{kind} buffer is not contiguous; pass a contiguous tensor")
        if not isinstance(offset, int) or offset < 0 or offset % ALIGN:
            raise ValueError(f"{kind} offset {offset!r} of {file.path} must be a multiple of {ALIGN}")
        if file.closed:
            raise ValueError(f"{kind} on a closed SwapFile ({file.path})")
        if file.direct and buffer.numel() and not is_aligned(buffer):
            raise ValueError(f"{kind} buffer at {buffer.data_ptr():#x} is not {ALIGN}-byte aligned, "
                             f"which O_DIRECT needs ({file.path}); allocate it with "
                             "zero_ext.nvme.aio.aligned_empty")
        return buffer.numel() * buffer.element_size()

    def _submit(self, kind: str, buffer: torch.Tensor, file, offset: int) -> AioRequest:
        if not isinstance(file, SwapFile):  # a path: opened for this request only
            with SwapFile(file, write=kind == "write", create=kind == "write") as f:
                return self._submit(kind, buffer, f, offset)
        nbytes = self._check(buffer, file, offset, kind)
        if kind == "read":
            size = file.size()
            if size < offset + nbytes:
                raise AioError(errno.EIO, f"{file.path} holds {size} bytes; a read of {nbytes} bytes "
                               f"at offset {offset} needs {offset + nbytes}: not the file this data "
                               "was written to (or it was truncated)", file.path)
        elif not file.writable:
            raise ValueError(f"write to {file.path}, which was opened for reading only")
        submit = self._handle.submit_read if kind == "read" else self._handle.submit_write
        try:
            op = submit(file.fd, buffer.data_ptr(), nbytes, offset, buffer)
        except OSError as exc:
            raise AioError(exc.errno, f"cannot submit {kind} of {nbytes} bytes at offset {offset} "
                           f"of {file.path}: {exc.strerror}", file.path) from None
        req = AioRequest(self, op, kind, file.path, offset, nbytes)
        self._requests[op] = req
        return req

    def submit_read(self, buffer: torch.Tensor, file: Union[SwapFile, PathLike], offset: int = 0) -> AioRequest:
        """Starts reading buffer.nbytes bytes of ``file`` at ``offset`` into ``buffer``; returns at
        once. The file must hold offset + nbytes bytes."""
        return self._submit("read", buffer, file, offset)

    def submit_write(self, buffer: torch.Tensor, file: Union[SwapFile, PathLike], offset: int = 0) -> AioRequest:
        """Starts writing ``buffer`` to ``file`` at ``offset`` (nbytes rounded up to 4096, the tail
        zero-filled); returns at once. Keep ``buffer`` unchanged until the request is waited."""
        return self._submit("write", buffer, file, offset)

    def read(self, buffer, file, offset: int = 0) -> None:
        self.submit_read(buffer, file, offset).wait()

    def write(self, buffer, file, offset: int = 0) -> None:
        self.submit_write(buffer, file, offset).wait()

    def _wait_one(self, req: AioRequest) -> None:
        res = self._handle.wait(req.op)
        self._requests.pop(req.op, None)
        req.finished = True
        if res is not None:
            req.error = _op_error(req.kind, req.path, req.offset, req.nbytes, res)

    def wait(self, request: Optional[AioRequest] = None) -> int:
        """Waits for ``request``, or for every request submitted and not yet waited. Returns how
        many finished; raises the first AioError among them once all have finished."""
        reqs = [request] if request is not None else sorted(self._requests.values(), key=lambda r: r.op)
        first = None
        for req in reqs:
            try:
                req.wait()
            except AioError as exc:
                first = first or exc
        if first is not None:
            raise first
        return len(reqs)

    @property
    def pending(self) -> int:
        return len(self._requests)

    # -- registered buffers -------------------------------------------------------------------------

    def register_buffers(self, tensors) -> bool:
        """Registers long-lived CPU tensors (swap buffer pools) with io_uring, adding to those
        registered before: requests inside one of them then use fixed-buffer I/O, whose pages the
        kernel pinned once here instead of on every request (measured on this project's machine:
        a quarter of the CPU time per byte read, half per byte written; see docs/nvme.md). The
        tensors are kept alive until unregistered or the AsyncIO is closed. Returns whether they
        are registered: False with the thread backend, or when the kernel refuses (RLIMIT_MEMLOCK
        without CAP_IPC_LOCK, memory it cannot pin); that is logged once and the requests run
        as before, so callers need not care."""
        new = {t.data_ptr(): t for t in tensors if t.numel() > 0}
        if not new or self.backend != "uring":
            return False
        for t in new.values():
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"register_buffers: contiguous CPU tensors only, not {t.device} "
                                 f"{tuple(t.shape)} (strides {t.stride()})")
        return self._set_registered({**self._registered, **new})

    @property
    def fixed_requests(self) -> int:
        """Requests so far that went through a registered buffer (see register_buffers)."""
        return self._handle.fixed_requests

    def unregister_buffers(self, tensors=None) -> None:
        """Forgets registered tensors (all of them for None). Call it before freeing or resizing
        a registered pool (the kernel keeps pinned pages, never a freed tensor's memory)."""
        if not self._registered:
            return
        drop = None if tensors is None else {t.data_ptr() for t in tensors}
        keep = {} if drop is None else {k: t for k, t in self._registered.items() if k not in drop}
        if len(keep) != len(self._registered):
            self._set_registered(keep)

    def _set_registered(self, tensors: Dict[int, torch.Tensor]) -> bool:
        ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors.values()]
        try:
            self._handle.register_buffers(ranges, list(tensors.values()))
        except (OSError, MemoryError) as exc:  # MemoryError: ENOMEM, past RLIMIT_MEMLOCK
            self._registered = {}
            why = exc.strerror if isinstance(exc, OSError) else "ENOMEM"
            _once(("register", why), "io_uring refused to register %d swap buffers of %d bytes (%s); "
                  "swap I/O runs without fixed buffers (raise RLIMIT_MEMLOCK (ulimit -l) or grant "
                  "CAP_IPC_LOCK to allow them)", len(ranges), sum(n for _, n in ranges), why)
            return False
        self._registered = tensors
        return bool(tensors)

    # -- lifetime -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancels requests not started, waits for those in flight, stops the workers. Requests
        not waited for are dropped (their wait() raises "cancelled" or reports what happened)."""
        if os.getpid() != self._pid:  # a forked child: the workers are the parent's
            self._requests.clear()
            self._handle.close()
            return
        for req in list(self._requests.values()):
            if req.done():
                self._wait_one(req)
        for req in self._requests.values():
            req.finished = True
            req.error = AioError(errno.ECANCELED, f"{req.kind} of {req.nbytes} bytes at offset "
                                 f"{req.offset} of {req.path} was dropped: the AsyncIO was closed "
                                 "before it was waited for", req.path)
        self._requests.clear()
        self._handle.close()
        self._registered = {}

    @property
    def closed(self) -> bool:
        return self._handle.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"AsyncIO(backend={self.backend!r}, block_size={self.block_size}, queue_depth="
                f"{self.queue_depth}, intra_op_parallelism={self.intra_op_parallelism}, "
                f"single_submit={self.single_submit}, overlap_events={self.overlap_events})")

    # -- DeepSpeed's aio_handle calls (ops.aio.AsyncIOBuilder().load().aio_handle) -------------------

    def get_block_size(self) -> int:
        return self.block_size

    def get_queue_depth(self) -> int:
        return self.queue_depth

    def get_single_submit(self) -> bool:
        return self.single_submit

    def get_overlap_events(self) -> bool:
        return self.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self.intra_op_parallelism

    def get_alignment(self) -> int:
        return ALIGN

    def async_pread(self, buffer: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        self.submit_read(buffer, filename, file_offset)
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        self.submit_write(buffer, filename, file_offset)
        return 0

    def sync_pread(self, buffer: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        self.read(buffer, filename, file_offset)
        return 1

    def sync_pwrite(self, buffer: torch.Tensor, filename: PathLike, file_offset: int = 0) -> int:
        self.write(buffer, filename, file_offset)
        return 1

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return aligned_empty(num_elem, example_tensor.dtype, pin_memory=torch.cuda.is_available())

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return True  # freed with its last reference
