"""Files of a checkpoint: atomic writes with checksums, verified reads, and the manifest.

Every file is written to a temporary name, fsynced, renamed, and its directory fsynced: a save killed
midway leaves no half file under a real name. Each file's sha256 is computed while it is written;
rank 0 records all of them, with the layout, in ``<tag>/zero_ext_manifest.json``, and only then
writes ``latest``. A load checks each file against the manifest before unpickling it, so a truncated
or corrupted shard is named, never silently loaded. Only torch is needed to read the files
(``weights_only=True``): they hold tensors, dicts, lists and numbers.
"""
import hashlib
import json
import os
from typing import Any, Dict

import torch

MANIFEST = "zero_ext_manifest.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded as it is: the message names the file and the problem."""


class _HashingWriter:
    """A file object that hashes what passes through it (torch.save writes sequentially)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()
        self.size = 0

    def write(self, data):
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_torch_save(obj: Any, path: str) -> Dict[str, Any]:
    """Saves obj to path atomically; returns {"sha256", "bytes"} of what was written."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return {"sha256": writer.sha.hexdigest(), "bytes": writer.size}


def file_digest(path: str) -> Dict[str, Any]:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
            size += len(block)
    return {"sha256": sha.hexdigest(), "bytes": size}


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


def verified_load(tag_dir: str, name: str, manifest: Dict[str, Any], check: bool = True) -> Any:
    """torch.load of one checkpoint file after checking it exists and matches the manifest's checksum."""
    path = os.path.join(tag_dir, name)
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{path}: the manifest does not list this file")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing (the checkpoint was saved by {manifest['world_size']} ranks; "
                              "every rank's file must be present)")
    if check:
        got = file_digest(path)
        if got["bytes"] != expected["bytes"]:
            raise CheckpointError(f"{path} is truncated or overwritten: {got['bytes']} bytes, the manifest "
                                  f"says {expected['bytes']}")
        if got["sha256"] != expected["sha256"]:
            raise CheckpointError(f"{path} is corrupted: its sha256 does not match the manifest")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
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
