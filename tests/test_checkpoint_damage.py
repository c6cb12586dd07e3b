"""Every way a checkpoint can be damaged is a CheckpointError naming the file and what is wrong, never a
silently wrong load, never code run from a file: the checksum itself (CRC-32C, csrc/checksum.c), files
of earlier versions (sha256), a missing or broken manifest, a `latest` naming a missing tag, a damaged
model file, crafted pickles in a shard whose checksum matches, and the files' permissions."""
import hashlib
import json
import os
import pickle
import zipfile

import pytest
import torch

from helpers.harness import RankFailed, run_ranks
from helpers.models import MLP

OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"
MANIFEST = "zero_ext_manifest.json"


def test_crc32c_is_the_castagnoli_crc_on_both_paths_and_continues_across_calls():
    from zero_ext import _C

    assert _C.crc32c(b"123456789") == _C.crc32c(b"123456789", table=True) == 0xE3069283  # the standard check value
    data = os.urandom(3 * 4096 * 5 + 77)  # several 3-lane blocks, a tail, unaligned starts below
    for start in (0, 1, 5):
        whole = _C.crc32c(data[start:])
        assert whole == _C.crc32c(data[start:], table=True)
        assert _C.crc32c(data[start + 1000:], _C.crc32c(data[start:start + 1000])) == whole
    assert _C.crc32c(memoryview(bytearray(data))) == _C.crc32c(data)
    assert _C.crc32c(b"") == 0


def _engine():
    import zero_ext

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}}
    return zero_ext.initialize(model=MLP(), config=config)[0]


def _save(root, umask=None):
    old = os.umask(umask) if umask is not None else None
    try:
        engine = _engine()
        loss = engine.module.loss(MLP.batch(2, torch.Generator().manual_seed(1)))
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(root, tag="t")
    finally:
        if old is not None:
            os.umask(old)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _load(root, tag="t"):
    engine = _engine()
    try:
        path, _ = engine.load_checkpoint(root, tag=tag)
        return "loaded", {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    except Exception as exc:  # noqa: BLE001 - the test looks at the type and the message
        return f"{type(exc).__name__}: {exc}", None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    params = run_ranks(1, _save, str(root))[0]
    return root, params


def _copy(saved, tmp_path):
    import shutil

    root = tmp_path / "c"
    shutil.copytree(saved[0], root)
    return root


def _manifest(root):
    return json.loads((root / "t" / MANIFEST).read_text())


def _write_manifest(root, manifest):
    (root / "t" / MANIFEST).write_text(json.dumps(manifest))


def test_a_checkpoint_of_an_earlier_version_with_sha256_sums_is_still_checked(saved, tmp_path):
    root = _copy(saved, tmp_path)
    manifest = _manifest(root)
    for name, entry in manifest["files"].items():
        entry.pop("crc32c")
        entry["sha256"] = hashlib.sha256((root / "t" / name).read_bytes()).hexdigest()
    _write_manifest(root, manifest)
    outcome, params = run_ranks(1, _load, str(root))[0]
    assert outcome == "loaded" and all(torch.equal(params[n], v) for n, v in saved[1].items())
    shard = root / "t" / OPTIM
    data = shard.read_bytes()
    shard.write_bytes(data[:-9] + bytes([data[-9] ^ 0x10]) + data[-8:])
    outcome, _ = run_ranks(1, _load, str(root))[0]
    assert outcome.startswith("CheckpointError") and f"{OPTIM} is corrupted: its sha256 does not match" in outcome


@pytest.mark.parametrize("damage,named,message", [
    ("no manifest", MANIFEST, "is missing: .* is not a complete zero_ext checkpoint"),
    ("manifest not json", MANIFEST, "is not valid JSON"),
    ("model file flipped", MODEL, "is corrupted: its crc32c does not match the manifest"),
    ("model file truncated", MODEL, "is truncated or overwritten"),
    ("latest names a missing tag", "gone", "does not exist"),
    ("tag folder is a file", "t", "does not exist"),
])
def test_each_damage_is_a_checkpoint_error_naming_the_file(saved, tmp_path, damage, named, message):
    import re

    root = _copy(saved, tmp_path)
    tag = "t"
    if damage == "no manifest":
        (root / "t" / MANIFEST).unlink()
    elif damage == "manifest not json":
        (root / "t" / MANIFEST).write_text('{"format_version": 1, "files": {')
    elif damage.startswith("model file"):
        f = root / "t" / MODEL
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if "truncated" in damage else data[:50] + bytes([data[50] ^ 4]) + data[51:])
    elif damage == "latest names a missing tag":
        (root / "latest").write_text("gone")
        tag = None
    else:
        import shutil

        shutil.rmtree(root / "t")
        (root / "t").write_text("not a folder")
    outcome, _ = run_ranks(1, _load, str(root), tag)[0]
    assert outcome.startswith("CheckpointError: "), outcome
    assert named in outcome and re.search(message, outcome), outcome


# -- crafted pickles: the checksum matches (an attacker can write the manifest too), weights_only refuses --------

class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w').close()",))


class _ImportsAnything:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (__import__("subprocess").call, (["touch", self.marker],))


class NotAllowed:  # a class of this test module: importable, but not on torch's weights_only list
    pass


def _payload(kind, marker):
    if kind == "os.system":
        return {"optimizer_state_dict": _RunsCode(marker)}
    if kind == "eval":
        return [_EvalsCode(marker)]
    if kind == "subprocess":
        return {"x": torch.zeros(2), "y": _ImportsAnything(marker)}
    return {"optimizer_state_dict": NotAllowed()}


def _write_torch_file(path, obj):
    torch.save(obj, path)


def _raw_pickle_in_torch_zip(path, marker):
    """A torch-format zip whose data.pkl is a hand-written pickle (GLOBAL posix.system + REDUCE)."""
    body = b"cposix\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR."
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", body)
        z.writestr("archive/version", "3\n")
        z.writestr("archive/byteorder", "little")


@pytest.mark.parametrize("kind", ["os.system", "eval", "subprocess", "class not allowed", "raw pickle",
                                  "legacy pickle"])
def test_crafted_pickles_in_a_shard_are_refused_and_never_run(saved, tmp_path, kind):
    from zero_ext import _C

    root = _copy(saved, tmp_path)
    marker = tmp_path / "ran"
    shard = root / "t" / OPTIM
    if kind == "raw pickle":
        _raw_pickle_in_torch_zip(shard, marker)
    elif kind == "legacy pickle":  # the pre-zip torch format: a bare pickle stream
        shard.write_bytes(pickle.dumps(_RunsCode(str(marker)), protocol=2))
    else:
        _write_torch_file(shard, _payload(kind, str(marker)))
    data = shard.read_bytes()
    manifest = _manifest(root)
    manifest["files"][OPTIM] = {"crc32c": f"{_C.crc32c(data):08x}", "bytes": len(data)}
    _write_manifest(root, manifest)
    outcome, _ = run_ranks(1, _load, str(root))[0]
    assert outcome.startswith("CheckpointError: ") and f"{OPTIM} cannot be read" in outcome, outcome
    assert not marker.exists()


def test_files_follow_the_umask_and_stay_private_under_077(tmp_path):
    for umask, file_mode, dir_mode in [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)]:
        root = tmp_path / f"u{umask:o}"
        run_ranks(1, _save, str(root), umask)
        for dirpath, dirs, files in os.walk(root):
            for d in dirs:
                assert os.stat(os.path.join(dirpath, d)).st_mode & 0o777 == dir_mode, (umask, d)
            for f in files:  # the recovery script is executable where it is readable, as DeepSpeed's
                want = dir_mode if f == "zero_to_fp32.py" else file_mode
                assert os.stat(os.path.join(dirpath, f)).st_mode & 0o777 == want, (umask, f)
