"""zero_ext.nvme.swap_dir: where swap files live: ``check_nvme_path`` and the per-run ``SwapDir``.

- ``check_nvme_path``: what the engine calls at initialize, before any training step: the directory
  exists, swap files can be created, written, read back and removed there, and it has room.
- ``SwapDir``: a per-run directory under ``nvme_path`` (mode 0700, files 0600), removed at clean
  exit and by ``destroy()``; directories left by crashed runs are never read, and are removed once
  their owner is gone (see [Note: swap directories]).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import tempfile
import time
import weakref
from typing import Optional

import torch

from .aio import ALIGN, AioError, PathLike, SwapFile, aligned_empty, free_bytes

logger = logging.getLogger("zero_ext.aio")

SWAP_DIR_PREFIX = "zero_ext_swap-"



def check_nvme_path(path: Optional[PathLike], need_bytes: int = 0) -> dict:
    """Checks, before any training, that ``path`` is a directory where swap files can be created,
    written, read back and removed, and that it has ``need_bytes`` free. Raises AioError (an OSError)
    naming the path and what to do; returns {"path", "direct" (O_DIRECT works), "free_bytes"}."""
    if path is None or os.fspath(path) == "":
        raise ValueError("nvme_path is not set: offload_param/offload_optimizer.nvme_path must name "
                         "a directory on a local NVMe drive")
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):  # made, as DeepSpeed does; private (0700): swap files hold the model's state
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise AioError(exc.errno, f"nvme_path {path} does not exist and cannot be created ({exc.strerror}): "
                           "create it (on a local NVMe drive) or fix nvme_path in the config", path) from None
    if not os.path.isdir(path):
        raise AioError(errno.ENOTDIR, f"nvme_path {path} is not a directory", path)
    probe = os.path.join(path, f".zero_ext_probe-{socket.gethostname()}-{os.getpid()}")
    try:
        with SwapFile(probe, create=True) as f:
            os.unlink(probe)
            page = aligned_empty(ALIGN)
            page.fill_(0x5A)
            back = aligned_empty(ALIGN)
            for data, kind, call in ((page, "write", os.pwritev), (back, "read", os.preadv)):
                mv = memoryview(data.numpy())
                try:
                    done = call(f.fd, [mv], 0)
                except OSError as exc:
                    raise AioError(exc.errno, f"nvme_path {path}: a test {kind} of {ALIGN} bytes "
                                   f"failed: {exc.strerror}", path) from None
                if done != ALIGN:
                    raise AioError(errno.EIO, f"nvme_path {path}: a test {kind} of {ALIGN} bytes "
                                   f"moved {done}", path)
            if not torch.equal(page, back):
                raise AioError(errno.EIO, f"nvme_path {path}: a page written and read back differs", path)
            direct = f.direct
    except AioError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise AioError(exc.errno, f"nvme_path {path} is not writable ({exc.strerror}): give "
                           "this user write access or choose another directory", path) from None
        raise
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    free = free_bytes(path)
    if need_bytes and free is not None and free < need_bytes:
        raise AioError(errno.ENOSPC, f"nvme_path {path}: {need_bytes} bytes needed for swap files, "
                       f"{free} bytes free: free space or choose a larger drive", path)
    return {"path": path, "direct": direct, "free_bytes": free}


# [Note: swap directories] Each run (each process) swaps into its own directory, made by mkdtemp
# under nvme_path: "zero_ext_swap-<host>-<pid>-<random>", mode 0700, holding a `.lock` file that the
# process keeps flock()ed while it lives. Nothing is ever read from a directory this process did
# not make, so a leftover from a crashed run can never pass for valid state. Its disk space is
# reclaimed by the next run on the same file system: a directory whose lock can be taken has no
# living owner (the kernel drops flock locks when a process dies, in any container), and is
# removed with a warning. A directory without a lock file is left alone for 10 minutes (its owner
# may be between mkdtemp and the lock).

def _remove_tree(path: str, lock_fd: Optional[int] = None) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if lock_fd is not None:
        os.close(lock_fd)


def _reap_leftovers(root: str) -> None:
    try:
        names = [n for n in os.listdir(root) if n.startswith(SWAP_DIR_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            try:
                if time.time() - os.stat(path).st_mtime > 600:
                    logger.warning("removing swap directory %s (no lock file: left by a crashed run)", path)
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a living run owns it
            continue
        logger.warning("removing swap directory %s left by a run that ended without cleaning up", path)
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


class SwapDir:
    """This run's directory under nvme_path; removed by destroy(), at clean exit, or when dropped."""

    def __init__(self, nvme_path: PathLike, *, check: bool = True, need_bytes: int = 0):
        root = os.path.abspath(os.fspath(nvme_path))
        self.direct = check_nvme_path(root, need_bytes)["direct"] if check else None
        _reap_leftovers(root)
        prefix = f"{SWAP_DIR_PREFIX}{socket.gethostname()}-{os.getpid()}-"
        try:
            self.path = tempfile.mkdtemp(prefix=prefix, dir=root)  # mode 0700
            # the lock file appears already locked (made under another name, locked, renamed): another
            # process's _reap_leftovers must never find it unlocked and take this live directory for dead
            pending = os.path.join(self.path, ".lock.new")
            lock = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)
            os.rename(pending, os.path.join(self.path, ".lock"))
        except OSError as exc:
            raise AioError(exc.errno, f"cannot create a swap directory in {root}: {exc.strerror}",
                           root) from None
        self._finalizer = weakref.finalize(self, _remove_tree, self.path, lock)

    def file(self, name: str) -> str:
        """The path of swap file ``name`` (a plain file name) in this directory."""
        if not name or os.sep in name or name.startswith("."):
            raise ValueError(f"swap file name {name!r} must be a plain file name")
        return os.path.join(self.path, name)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def destroy(self) -> None:
        """Removes the directory and every swap file in it (idempotent)."""
        self._finalizer()

    def __repr__(self):
        return f"SwapDir({self.path!r}{'' if self.alive else ', destroyed'})"
