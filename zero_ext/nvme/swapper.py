"""zero_ext.nvme.swapper: ``NVMeSwapper``, whole CPU tensors swapped by name to files of a ``SwapDir``.

Only what this run wrote can be read back, and only into a tensor of the size written.
"""
from __future__ import annotations

import errno
import os
from typing import Dict, Optional, Union

import torch

from .aio import AioError, AioRequest, AsyncIO, PathLike, SwapFile, free_bytes, round_up
from .swap_dir import SwapDir


class NVMeSwapper:
    """Whole CPU tensors swapped by name to files of a per-run SwapDir.

    ``swap_out(name, t)`` and ``swap_in(name, t)`` return requests (``.wait()``); ``wait()`` waits
    for all. A name can be read back only after this run wrote it, into a tensor of the same
    size, and only if that write succeeded. Space is reserved (fallocate) when a file is created
    or grows, so a full drive fails there, at once, with the bytes needed and free."""

    def __init__(self, nvme_path: PathLike, aio: Union[AsyncIO, dict, None, object] = None):
        self.dir = SwapDir(nvme_path)
        self._own_aio = not isinstance(aio, AsyncIO)
        self.aio = AsyncIO.from_config(aio) if self._own_aio else aio
        self._files: Dict[str, SwapFile] = {}
        self._written: Dict[str, tuple] = {}  # name -> (nbytes, the write's request)

    def _file(self, name: str) -> SwapFile:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = SwapFile(self.dir.file(name), create=True)
        return f

    def _reserve(self, f: SwapFile, nbytes: int) -> None:
        need = round_up(nbytes)
        size = f.size()
        if size == need:
            return
        try:
            if size > need:
                os.ftruncate(f.fd, need)
            else:
                os.posix_fallocate(f.fd, 0, need)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL) and size < need:
                return  # no fallocate here: the write itself reports a full drive
            free = free_bytes(f.path)
            raise AioError(exc.errno, f"cannot reserve {need} bytes for {f.path}: {exc.strerror} "
                           f"({need - size} bytes needed, {free} bytes free on its file system); "
                           "free space under nvme_path or point it to a larger drive", f.path) from None

    def reserve(self, name: str, nbytes: int) -> None:
        """Creates swap file ``name`` with room for ``nbytes`` (AioError when the drive has not), to be
        written later; it holds nothing readable until then."""
        self._reserve(self._file(name), nbytes)

    def swap_out(self, name: str, tensor: torch.Tensor) -> AioRequest:
        """Starts writing ``tensor`` to swap file ``name``. Keep it unchanged until waited."""
        f = self._file(name)
        nbytes = tensor.numel() * tensor.element_size()
        prior = self._written.pop(name, None)
        if prior is not None and not prior[1].finished:
            prior[1].wait()  # never two writes of one file in flight
        self._reserve(f, nbytes)
        req = self.aio.submit_write(tensor, f)
        self._written[name] = (nbytes, req)
        return req

    def swap_in(self, name: str, tensor: torch.Tensor) -> AioRequest:
        """Starts reading swap file ``name`` back into ``tensor`` (of the size written)."""
        if name not in self._written:
            raise KeyError(f"no tensor named {name!r} was swapped out by this run "
                           f"(swap files of {self.dir.path})")
        nbytes, write = self._written[name]
        if not write.finished:
            write.wait()
        if write.error is not None:
            raise AioError(write.error.errno, f"swap file {name!r} holds no valid data: its write "
                           f"failed ({write.error.strerror})", write.path)
        want = tensor.numel() * tensor.element_size()
        if want != nbytes:
            raise ValueError(f"swap_in({name!r}) into a tensor of {want} bytes; {nbytes} were "
                             "swapped out")
        f = self._files[name]
        size = f.size()
        if size != round_up(nbytes):
            raise AioError(errno.EIO, f"swap file {f.path} is {size} bytes; {round_up(nbytes)} "
                           f"expected for the {nbytes} bytes swapped out: it was changed outside "
                           "zero_ext", f.path)
        return self.aio.submit_read(tensor, f)

    def wait(self, request: Optional[AioRequest] = None) -> int:
        return self.aio.wait(request)

    def remove(self, name: str) -> None:
        """Forgets swap file ``name`` and deletes it (after its write, if any, finished)."""
        entry = self._written.pop(name, None)
        if entry is not None and not entry[1].finished:
            try:
                entry[1].wait()
            except AioError:
                pass
        f = self._files.pop(name, None)
        if f is not None:
            f.close()
            os.unlink(f.path)

    def destroy(self) -> None:
        """Closes the AsyncIO if this swapper made it, and removes the swap directory."""
        if self._own_aio:
            self.aio.close()
        else:
            for _, req in list(self._written.values()):
                if not req.finished:
                    try:
                        req.wait()
                    except AioError:
                        pass
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._written.clear()
        self.dir.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
