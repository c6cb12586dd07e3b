"""Test-only file-system tools: a forked child for state this process must not keep, a file system of
the test's own (mounted under tmp_path, or the test skips saying why), and the fixture that unmounts
them again. Used by the NVMe tests (tests/test_nvme_*.py); the ``mounts`` fixture is registered in
conftest.py, so tests ask for it by name."""
import errno
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


def fill_up(folder):
    """Writes a file "filler" into ``folder`` until its file system is full (ENOSPC)."""
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def lose_reservation(swap_file, full):
    """Makes the next write to an open swap file (an aio SwapFile) fail as a lost reservation does:
    its descriptor is pointed at a sparse file of its size on the small file system ``full``, which is
    then filled up. Reads give zeros; writes get the kernel's ENOSPC until full/filler is removed."""
    fd = os.open(os.path.join(full, "victim"), os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, swap_file.size())  # the same size, no blocks
    fill_up(full)
    os.dup2(fd, swap_file.fd)
    os.close(fd)
