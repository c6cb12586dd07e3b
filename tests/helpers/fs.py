"""Test-only file-system tools: a forked child for state this process must not keep, a file system of
the test's own (mounted under tmp_path, or the test skips saying why), and the fixture that unmounts
them again. Used by the NVMe tests (tests/test_nvme_*.py); the ``mounts`` fixture is registered in
conftest.py, so tests ask for it by name."""
import os
import pickle
import subprocess

import pytest


def in_child(fn, *args):
    """Runs fn(*args) in a forked child and returns what it returns (or raises what it raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = ("ok", fn(*args))
        except BaseException as exc:  # noqa: BLE001 - sent to the parent
            out = ("err", exc)
        with os.fdopen(w, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "err":
        raise value
    return value


def mount(tmp_path, fstype, options="", name="mnt"):
    """Mounts a fresh `fstype` on tmp_path/name, or skips the test saying why it cannot."""
    target = tmp_path / name
    target.mkdir()
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(target)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if out.returncode:
        pytest.skip(f"mounting {fstype} is not permitted here: {out.stderr.strip()}")
    return target


@pytest.fixture
def mounts():
    made = []
    yield made
    for target in made:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)
