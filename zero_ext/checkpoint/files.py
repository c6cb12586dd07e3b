"""Files of a checkpoint: checksummed writes, verified reads, the manifest, and the tag's folder.

A save writes every file into a hidden staging folder (``staging_dir``) under its final name, computing
its CRC-32C as it goes (csrc/checksum.c, at memory speed; checkpoints of earlier versions carry a sha256,
still checked); rank 0 records all of them, with the layout, in ``<tag>/zero_ext_manifest.json``. Then
the files and the folder are fsynced and the folder is put in place under its tag in one step
(``publish_dir``), and only then is ``latest`` written (publish.py runs that part in the background). A
save killed midway, or reusing an existing tag, never leaves a half file or a mix of two saves under a
tag. A load checks each file against the manifest before unpickling it, so a truncated or corrupted
shard is named, never silently loaded. Only torch is needed to read the files (``weights_only=True``):
they hold tensors, dicts, lists and numbers.
"""
import ctypes
import enum
import errno
import hashlib
import json
import mmap
import os
import shutil
import warnings
from typing import Any, Dict

import torch

from .. import _C

# read-only mappings, populated at once where the platform can (one call instead of a fault per page)
_MAP = {"flags": mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), "prot": mmap.PROT_READ}
MANIFEST = "zero_ext_manifest.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded as it is: the message names the file and the problem."""


_WRITEBACK_BYTES = 16 << 20  # start the disk write of each 16 MiB written, so the final fsync waits for the tail only
_LIBC = ctypes.CDLL(None, use_errno=True)
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Asks the kernel to begin writing [offset, offset + nbytes) of fd to disk now (sync_file_range,
    Linux; elsewhere nothing: the fsync at the end writes everything)."""
    try:
        _LIBC.sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(nbytes), _SYNC_FILE_RANGE_WRITE)
    except AttributeError:
        pass


class _HashingWriter:
    """A file object that checksums what passes through it (torch.save writes sequentially) and starts
    the disk write of what it has written every _WRITEBACK_BYTES."""

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0
        self.fd, self.synced = f.fileno(), 0

    def write(self, data):
        self.crc = _C.crc32c(data, self.crc)
        self.size += len(data)
        n = self.f.write(data)
        if self.size - self.synced >= _WRITEBACK_BYTES:
            self.f.flush()
            _start_writeback(self.fd, self.synced, self.size - self.synced)
            self.synced = self.size
        return n

    def flush(self):
        self.f.flush()

    def digest(self) -> Dict[str, Any]:
        return {"crc32c": f"{self.crc:08x}", "bytes": self.size}


def fsync_dir(path: str) -> None:
    """Makes a folder's entries durable (a file's data too: fsync_file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes, sync_dir: bool = True, if_changed: bool = False,
                       mode: int = None) -> None:
    """Writes path atomically (``sync_dir``: see atomic_torch_save). ``if_changed``: nothing is written
    when path holds these bytes already. ``mode``: the file's permissions (default: from the umask)."""
    if if_changed and os.path.isfile(path) and os.path.getsize(path) == len(data):
        with open(path, "rb") as f:
            if f.read() == data:
                return
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        if mode is not None:
            os.fchmod(f.fileno(), mode)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_torch_save(obj: Any, path: str, sync_dir: bool = True) -> Dict[str, Any]:
    """Saves obj to path atomically; returns {"crc32c", "bytes"} of what was written. ``sync_dir=False``:
    the caller fsyncs the folder once after all its files (checkpoint folders do)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb", buffering=0) as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    return writer.digest()


class _NoZipCrc:
    """torch.save without the zip CRC-32 of each record (torch >= 2.5): the file's CRC-32C above guards
    the same bytes, at a tenth of the cost (zip's table CRC took 60% of a shard's write). torch.load
    never checks the zip CRC, so the files load as any others (``unzip -t`` would complain)."""

    def __enter__(self):
        get = getattr(torch.serialization, "get_crc32_options", None)
        self.was = get() if get is not None else None
        if self.was:
            torch.serialization.set_crc32_options(False)

    def __exit__(self, *exc):
        if self.was:
            torch.serialization.set_crc32_options(True)


def write_torch_file(obj: Any, path: str) -> Dict[str, Any]:
    """torch.save of obj to path, a new name inside a staging folder (not yet published: no temporary
    name, no fsync here: publish.py fsyncs before publishing); returns {"crc32c", "bytes"}."""
    with open(path, "wb", buffering=0) as f:
        writer = _HashingWriter(f)
        with _NoZipCrc():
            torch.save(obj, writer)
    return writer.digest()


def fsync_file(path: str) -> None:
    """Makes the file's data durable (any descriptor of the file will do: the page cache is the inode's)."""
    fsync_dir(path)  # (the same call: a read-only descriptor of the path, fsynced)


def file_digest(path: str, kind: str = "crc32c") -> Dict[str, Any]:
    """``kind`` ("crc32c", or "sha256" for checkpoints of earlier zero_ext versions) and size of a file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if kind == "sha256":
            sha = hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
            return {"sha256": sha.hexdigest(), "bytes": size}
        if size == 0:
            return {"crc32c": f"{0:08x}", "bytes": 0}
        with mmap.mmap(f.fileno(), 0, **_MAP) as m:
            return {"crc32c": f"{_C.crc32c(m):08x}", "bytes": size}


def read_manifest(tag_dir: str) -> Dict[str, Any]:
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: {tag_dir} is not a complete zero_ext checkpoint (a save "
                              "that did not finish, or another tool's checkpoint)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('format_version')!r}, this zero_ext reads "
                              f"version {FORMAT_VERSION}")
    return manifest


def verified_load(tag_dir: str, name: str, manifest: Dict[str, Any], check: bool = True,
                  mapped: bool = False) -> Any:
    """torch.load of one checkpoint file after checking it exists and matches the manifest's checksum.
    ``mapped``: its tensors are views of a private mapping of the file, read from the page cache only
    when touched (no copy made: the caller copies them where they go and must keep none of them, or the
    file stays mapped: shards.owned)."""
    path = os.path.join(tag_dir, name)
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{path}: the manifest does not list this file")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing (the checkpoint was saved by {manifest['world_size']} ranks; "
                              "every rank's file must be present)")
    if check:
        size = os.stat(path).st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{path} is truncated or overwritten: {size} bytes, the manifest "
                                  f"says {expected['bytes']}")
        kind = "crc32c" if "crc32c" in expected else "sha256"
        if file_digest(path, kind)[kind] != expected[kind]:
            raise CheckpointError(f"{path} is corrupted: its {kind} does not match the manifest")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise CheckpointError(f"{path} cannot be read: {exc}") from None


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """``item`` (a tensor, or lists / tuples / dicts of them) with every tensor cloned to ``device``, so that
    torch.save writes each tensor's own values rather than the whole storage a view shares
    (DeepSpeed's ``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item


def plain_data(value: Any) -> Any:
    """``value`` as JSON's types (dicts with string keys, lists, strings, numbers, booleans, None), for what
    a checkpoint keeps of the user's own objects (the config): ``weights_only`` loading, ours or
    anyone's, refuses other classes (an Enum a script put in its config would make the checkpoint
    unloadable). Enums become their values; other objects their str()."""
    if isinstance(value, enum.Enum):
        return plain_data(value.value)
    if isinstance(value, dict):
        return {str(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# -- folders --------------------------------------------------------------------------------------------------

def check_tag(tag: str, source: str) -> str:
    """``tag`` names one folder directly inside the checkpoint folder: a plain name, neither hidden nor a
    path (``../x`` or an absolute path would write or read outside it). ``source`` says where it came
    from, for the message."""
    bad = (not tag or tag in (".", "..") or tag.startswith(".") or "\0" in tag
           or any(sep and sep in tag for sep in (os.sep, os.altsep, "/")))
    if bad:
        raise CheckpointError(f"checkpoint tag {tag!r} ({source}) is not a plain folder name: a tag names one "
                              "folder inside the checkpoint folder (no '/', not '.' or '..', not starting with '.')")
    return tag


def staging_dir(save_dir: str, tag: str) -> str:
    """Where a save of ``tag`` is written before it replaces the tag's folder (see publish_dir)."""
    return os.path.join(save_dir, f".{tag}.saving")


def replaced_dir(save_dir: str, tag: str) -> str:
    """Where the previous folder of ``tag`` waits while a save replaces it without renameat2."""
    return os.path.join(save_dir, f".{tag}.replaced")


def _exchange(a: str, b: str) -> bool:
    """Swaps two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def publish_dir(staging: str, final: str, aside: str) -> None:
    """Makes the complete folder ``staging`` the folder ``final``, in one atomic step when ``final``
    exists already (renameat2 exchange), so a save killed at any point leaves either the old checkpoint
    or the new one under the tag, never a mix. Where the exchange is refused, the old folder is moved to
    ``aside`` first, and a load finds it there (find_tag_dir)."""
    parent = os.path.dirname(os.path.abspath(final))
    if not os.path.exists(final):
        os.rename(staging, final)
    elif _exchange(staging, final):
        shutil.rmtree(staging)  # (now the old folder)
    else:
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(staging, final)
        shutil.rmtree(aside)
    fsync_dir(parent)


def find_tag_dir(load_dir: str, tag: str) -> str:
    """The folder of ``tag``: normally ``load_dir/tag``; after a save killed between the two renames of
    publish_dir's fallback, the previous checkpoint under its aside name."""
    final = os.path.join(load_dir, tag)
    aside = replaced_dir(load_dir, tag)
    if not os.path.isdir(final) and os.path.isdir(aside):
        warnings.warn(f"load_checkpoint: {final} is missing but {aside} holds the checkpoint a killed save was "
                      "replacing; loading that one", RuntimeWarning, stacklevel=3)
        return aside
    return final


def reap_temporary_files(folder: str) -> None:
    """Removes ``*.tmp.<pid>`` files of this host's processes that no longer run (killed saves)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        stem, dot, pid = name.rpartition(".tmp.")
        if not dot or not stem or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass
