"""NVMe swap I/O (csrc/aio.c; zero_ext/nvme/aio.py, swap_dir.py, swapper.py): both backends on real files
of the local disk.

io_uring tests skip, with the kernel's reason, where this process may not use it; the pread/pwrite
thread pool is tested always. Tests that need a file system of their own (ramfs refusing O_DIRECT,
a small tmpfs that fills up, a read-only one) mount it under tmp_path and skip, saying why, where
mount is not permitted. Children that must not share this process's state (seccomp, setuid,
RLIMIT_FSIZE, a crash) are forked.
"""
import errno
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

from zero_ext import _C
from zero_ext.nvme import aio
from zero_ext.nvme.aio import ALIGN, AioError, AsyncIO, aligned_empty
from zero_ext.nvme.swap_dir import SwapDir, check_nvme_path
from zero_ext.nvme.swapper import NVMeSwapper

from helpers import ROOT
from helpers.fs import in_child, mount

URING_ERRNO = _C.aio_uring_probe()
URING_SKIP = f"io_uring refused by this kernel: {os.strerror(URING_ERRNO)}" if URING_ERRNO else ""
BACKENDS = [pytest.param("uring", marks=pytest.mark.skipif(bool(URING_ERRNO), reason=URING_SKIP or "-")),
            "threads"]


def rand_bytes(n, seed=0):
    t = aligned_empty(n)
    t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return t


@pytest.fixture(params=BACKENDS)
def handle(request):
    with AsyncIO(block_size=64 << 10, queue_depth=4, backend=request.param) as h:
        yield h


# ---------------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, (64 << 10) * 3, (1 << 20) + 123, 3 << 20])
def test_write_read_round_trip(handle, tmp_path, nbytes):
    data = rand_bytes(nbytes, seed=nbytes)
    path = tmp_path / "swap"
    with handle.open(path, create=True) as f:
        assert f.direct  # ext4/xfs on the local disk take O_DIRECT
        handle.submit_write(data, f).wait()
        assert f.size() == aio.round_up(nbytes)
        back = aligned_empty(nbytes)
        back.fill_(7)
        handle.submit_read(back, f).wait()
    assert torch.equal(back, data)
    raw = path.read_bytes()
    assert raw[:nbytes] == data.numpy().tobytes() and raw[nbytes:] == b"\0" * (len(raw) - nbytes)


def test_float_tensors_and_byte_ranges_of_one_file(handle, tmp_path):
    a = aligned_empty(1000, torch.float32).normal_()
    b = aligned_empty((33, 77), torch.bfloat16).normal_()
    c = aligned_empty(50000, torch.int64).random_()
    offsets = [0, aio.round_up(a.nbytes), aio.round_up(a.nbytes) + aio.round_up(b.nbytes)]
    with handle.open(tmp_path / "ranges", create=True) as f:
        reqs = [handle.submit_write(t, f, off) for t, off in zip((a, b, c), offsets)]
        assert handle.wait() == 3 and all(r.finished and r.error is None for r in reqs)
        outs = [aligned_empty(t.shape, t.dtype) for t in (c, a, b)]
        for t, off in zip(outs, (offsets[2], offsets[0], offsets[1])):
            handle.submit_read(t, f, off)
        handle.wait()
        # a byte range in the middle of a tensor, into the middle of a buffer
        part = aligned_empty(2 * 4096, torch.uint8)
        handle.read(part, f, offsets[2] + 4096)
    assert torch.equal(outs[0], c) and torch.equal(outs[1], a) and torch.equal(outs[2], b)
    assert torch.equal(part, c.view(torch.uint8)[4096:3 * 4096])


def test_read_does_not_touch_memory_past_the_tensor(handle, tmp_path):
    data = rand_bytes(4096 + 100)
    buf = aligned_empty(3 * 4096)
    buf.fill_(0xEE)
    with handle.open(tmp_path / "tail", create=True) as f:
        handle.write(data, f)
        handle.read(buf[:4096 + 100], f)
    assert torch.equal(buf[:4196], data)
    assert bool((buf[4196:] == 0xEE).all())  # the padded tail went through a bounce page


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("settings", [dict(overlap_events=False), dict(single_submit=True),
                                      dict(intra_op_parallelism=3, queue_depth=2),
                                      dict(thread_count=2, queue_depth=1, block_size=4096)])
def test_every_aio_setting_moves_the_same_bytes(backend, settings, tmp_path):
    settings = {"block_size": 16 << 10, **settings}
    data = rand_bytes((1 << 20) + 5000, seed=3)
    back = aligned_empty(data.numel())
    with AsyncIO(backend=backend, **settings) as h:
        h.write(data, tmp_path / "s")
        h.read(back, tmp_path / "s")
    assert torch.equal(back, data)


def test_aligned_empty_sizes_dtypes_and_lifetime():
    for shape, dtype in ((0, torch.uint8), (5, torch.float16), ((3, 1000), torch.float32),
                         ((1 << 20) + 1, torch.float32), ((512, 1024), torch.bfloat16)):
        t = aligned_empty(shape, dtype)
        assert aio.is_aligned(t) and t.dtype == dtype and t.is_contiguous()
        assert t.shape == ((shape,) if isinstance(shape, int) else shape)
        t.fill_(1)
    big = aligned_empty(4 << 20)
    assert big.data_ptr() % aio.HUGE_PAGE == 0  # its own mapping, on a huge page boundary
    view = big[4096:]
    del big
    view.fill_(3)  # the mapping lives as long as any view of it
    assert int(view[-1]) == 3


def test_many_requests_in_flight_at_once(handle, tmp_path):
    tensors = [rand_bytes(100_000 + 4096 * i, seed=i) for i in range(24)]
    files = [handle.open(tmp_path / f"f{i}", create=True) for i in range(len(tensors))]
    reqs = [handle.submit_write(t, f) for t, f in zip(tensors, files)]
    assert handle.pending == 24
    assert handle.wait() == 24 and handle.pending == 0
    backs = [aligned_empty(t.numel()) for t in tensors]
    reqs = [handle.submit_read(b, f) for b, f in zip(backs, files)]
    for r in reversed(reqs):  # any order
        r.wait()
        assert r.done()
    assert all(torch.equal(a, b) for a, b in zip(tensors, backs))
    for f in files:
        f.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_wait_releases_the_gil(backend, tmp_path):
    data = rand_bytes(8 << 20)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    # one 4 KiB request at a time: slow enough to see the other thread run during wait()
    with AsyncIO(block_size=4096, queue_depth=1, overlap_events=False, backend=backend) as h:
        h.write(data, tmp_path / "g")
        th = threading.Thread(target=ticker)
        th.start()
        time.sleep(0.01)
        req = h.submit_read(aligned_empty(data.numel()), tmp_path / "g")
        t0 = time.perf_counter()
        req.wait()
        t1 = time.perf_counter()
        stop.set()
        th.join()
    during = [t for t in ticks if t0 < t < t1]
    assert t1 - t0 > 0.02, "the read was too fast to tell"
    assert len(during) >= 5, f"another thread ran {len(during)} times in a {t1 - t0:.3f} s wait"


def test_buffers_stay_alive_until_waited_and_closing_is_safe(tmp_path):
    for backend in ("uring", "threads") if not URING_ERRNO else ("threads",):
        h = AsyncIO(block_size=4096, queue_depth=1, backend=backend)
        t = rand_bytes(4 << 20)
        alive = weakref.ref(t)
        req = h.submit_write(t, tmp_path / f"k-{backend}")
        del t
        assert alive() is not None  # the C handle holds the tensor while the write runs
        req.wait()
        assert alive() is None
        # closing (or dropping) with requests queued and in flight: no crash, no use after free
        reqs = [h.submit_write(rand_bytes(1 << 20, seed=i), tmp_path / f"c{i}") for i in range(8)]
        h.close()
        assert h.closed and h.pending == 0
        cancelled = 0
        for r in reqs:  # each finished before close(), or reports that close() dropped it
            assert r.finished
            if r.error is not None:
                with pytest.raises(AioError, match="closed") as info:
                    r.wait()
                assert info.value.errno == errno.ECANCELED
                cancelled += 1
        assert cancelled > 0
        with pytest.raises(ValueError, match="closed"):
            h.submit_write(rand_bytes(10), tmp_path / "x")
        h2 = AsyncIO(block_size=4096, queue_depth=1, backend=backend)
        for i in range(4):
            h2.submit_write(rand_bytes(1 << 20, seed=i), tmp_path / f"d{i}")
        del h2  # dealloc waits for what runs, then releases the tensors


# ---------------------------------------------------------------------------------------------------
# Backend choice


def test_env_forces_the_backend(monkeypatch):
    monkeypatch.setenv("ZERO_EXT_AIO", "threads")
    with AsyncIO() as h:
        assert h.backend == "threads"
    monkeypatch.setenv("ZERO_EXT_AIO", "bogus")
    with pytest.raises(ValueError, match="ZERO_EXT_AIO='bogus'"):
        AsyncIO()
    monkeypatch.setenv("ZERO_EXT_AIO", "uring")
    if URING_ERRNO:
        with pytest.raises(AioError, match="refuses io_uring"):
            AsyncIO()
    else:
        with AsyncIO() as h:
            assert h.backend == "uring"
    monkeypatch.delenv("ZERO_EXT_AIO")
    with AsyncIO() as h:
        assert h.backend == ("threads" if URING_ERRNO else "uring")


def _under_seccomp_refusing_io_uring(tmp):
    """In a child: forbid io_uring_setup (EPERM, as container runtimes do), then use AsyncIO."""
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    # BPF: load the syscall number; io_uring_setup (425) -> ERRNO(EPERM); else allow
    prog = [(0x20, 0, 0, 0), (0x15, 0, 1, 425), (0x06, 0, 0, 0x00050000 | errno.EPERM),
            (0x06, 0, 0, 0x7FFF0000)]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    filt = ctypes.create_string_buffer(raw)
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(filt))
    fbuf = ctypes.create_string_buffer(fprog)
    ul = ctypes.c_ulong
    assert libc.prctl(38, ul(1), ul(0), ul(0), ul(0)) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, ul(2), ul(ctypes.addressof(fbuf)), ul(0), ul(0)) == 0  # SECCOMP, FILTER
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    aio.logger.addHandler(Keep())
    aio._probe_errno = None
    aio._said.clear()
    os.environ.pop("ZERO_EXT_AIO", None)
    out = {"probe": _C.aio_uring_probe()}
    with AsyncIO() as h, AsyncIO() as h2:
        out["backends"] = (h.backend, h2.backend)
        data = rand_bytes(100_000)
        h.write(data, os.path.join(tmp, "sec"))
        back = aligned_empty(data.numel())
        h2.read(back, os.path.join(tmp, "sec"))
        out["equal"] = torch.equal(back, data)
    out["logs"] = records
    os.environ["ZERO_EXT_AIO"] = "uring"
    try:
        AsyncIO()
    except AioError as exc:
        out["forced"] = (exc.errno, str(exc))
    return out


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter is written for x86_64")
def test_io_uring_refused_falls_back_to_threads_and_says_so_once(tmp_path):
    out = in_child(_under_seccomp_refusing_io_uring, str(tmp_path))
    assert out["probe"] == errno.EPERM
    assert out["backends"] == ("threads", "threads") and out["equal"]
    assert len(out["logs"]) == 1 and "io_uring is refused" in out["logs"][0] and "EPERM" in out["logs"][0]
    assert out["forced"][0] == errno.EPERM and "ZERO_EXT_AIO=uring" in out["forced"][1]


# ---------------------------------------------------------------------------------------------------
# File systems: no O_DIRECT, full, read-only; the nvme_path check


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_system_refusing_o_direct_gets_buffered_io_with_one_warning(backend, tmp_path, mounts, caplog):
    target = mount(tmp_path, "ramfs")  # ramfs has no O_DIRECT (tmpfs has it since Linux 6.6)
    mounts.append(target)
    aio._said.clear()
    caplog.set_level(logging.WARNING, logger="zero_ext.aio")
    data = rand_bytes(300_001)
    unaligned = torch.empty(300_001 + 1, dtype=torch.uint8)[1:]  # fine without O_DIRECT
    with AsyncIO(block_size=64 << 10, backend=backend) as h:
        with h.open(target / "a", create=True) as f, h.open(target / "b", create=True) as g:
            assert not f.direct and not g.direct
            h.write(data, f)
            h.read(unaligned, f)
            h.write(unaligned, g)
        assert check_nvme_path(target)["direct"] is False
    assert torch.equal(unaligned, data)
    assert os.path.getsize(target / "a") == aio.round_up(data.numel())  # same layout as with O_DIRECT
    warnings = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1 and str(target) in warnings[0].getMessage()


def test_o_direct_refusal_forced_without_a_mount(tmp_path, monkeypatch, caplog):
    """The same fallback where mount is not permitted: open() refuses O_DIRECT with EINVAL."""
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    aio._said.clear()
    caplog.set_level(logging.WARNING, logger="zero_ext.aio")
    data = rand_bytes(10_000)
    with AsyncIO(backend="threads") as h, h.open(tmp_path / "buffered", create=True) as f:
        assert not f.direct
        h.write(data, f)
        back = torch.empty(10_000, dtype=torch.uint8)
        h.read(back, f)
    assert torch.equal(back, data)
    assert sum("refuses O_DIRECT" in r.getMessage() for r in caplog.records) == 1


def _assert_enospc(exc, path, nbytes):
    msg = str(exc)
    assert exc.errno == errno.ENOSPC and exc.filename == str(path), msg
    assert f"{nbytes} bytes" in msg and "bytes needed" in msg and "bytes free" in msg, msg
    assert "No space left on device" in msg and "offset" in msg, msg


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_file_system_is_enospc_with_bytes_needed_and_free(backend, tmp_path, mounts):
    target = mount(tmp_path, "tmpfs", "size=1m")
    mounts.append(target)
    data = rand_bytes(3 << 20)
    with AsyncIO(block_size=256 << 10, queue_depth=4, backend=backend) as h:
        with pytest.raises(AioError) as info:
            h.write(data, target / "big")
        _assert_enospc(info.value, target / "big", 3 << 20)
        os.unlink(target / "big")
        # the swapper reserves space first, so it fails before any I/O, saying what is free
        with NVMeSwapper(target, h) as sw:
            with pytest.raises(AioError) as info:
                sw.swap_out("state", data)
            assert info.value.errno == errno.ENOSPC and "bytes free" in str(info.value)
            with pytest.raises(KeyError):
                sw.swap_in("state", data)  # nothing valid was written
    with pytest.raises(AioError, match="bytes needed for swap files") as info:
        check_nvme_path(target, need_bytes=2 << 20)
    assert info.value.errno == errno.ENOSPC


def _write_over_rlimit(path, backend):
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    with AsyncIO(block_size=256 << 10, backend=backend) as h:
        try:
            h.write(rand_bytes(3 << 20), path)
        except AioError as exc:
            return exc.errno, str(exc)
    return None


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_size_limit_is_efbig(backend, tmp_path):
    """RLIMIT_FSIZE stands in for a full drive where mount is not permitted; it gives EFBIG."""
    out = in_child(_write_over_rlimit, str(tmp_path / "lim"), backend)
    assert out is not None, "a write past RLIMIT_FSIZE succeeded"
    err, msg = out
    assert err == errno.EFBIG and "RLIMIT_FSIZE" in msg and str(tmp_path / "lim") in msg, msg


def test_nvme_path_check_makes_a_missing_path_and_names_wrong_ones(tmp_path):
    made = tmp_path / "new" / "swap"  # made, as DeepSpeed does, private
    assert check_nvme_path(made)["free_bytes"] > 0
    assert made.is_dir() and os.stat(made).st_mode & 0o777 == 0o700 and os.listdir(made) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(AioError, match="does not exist and cannot be created .*Not a directory") as info:
        check_nvme_path(tmp_path / "file" / "swap")  # under a file: cannot be made
    assert info.value.errno == errno.ENOTDIR and info.value.filename == str(tmp_path / "file" / "swap")
    with pytest.raises(AioError, match="not a directory"):
        check_nvme_path(tmp_path / "file")
    with pytest.raises(ValueError, match="nvme_path is not set"):
        check_nvme_path(None)
    info = check_nvme_path(tmp_path)
    assert info["direct"] is True and info["free_bytes"] > 0 and sorted(os.listdir(tmp_path)) == ["file", "new"]


def test_nvme_path_check_refuses_a_read_only_file_system(tmp_path, mounts):
    target = mount(tmp_path, "tmpfs", "size=1m,ro")
    mounts.append(target)
    with pytest.raises(AioError, match="is not writable") as info:
        check_nvme_path(target)
    assert info.value.errno == errno.EROFS and str(target) in str(info.value)
    with pytest.raises(AioError, match="cannot be created") as info:
        check_nvme_path(target / "swap")
    assert info.value.errno == errno.EROFS


def _check_as_nobody(path):
    os.setgid(65534)
    os.setuid(65534)
    check_nvme_path(path)


def test_nvme_path_check_refuses_an_unwritable_directory():
    import tempfile

    target = tempfile.mkdtemp(prefix="zero_ext_ro-")  # in /tmp: reachable by any user
    try:
        os.chmod(target, 0o555)
        if os.geteuid() == 0:  # root writes anywhere: check as nobody
            call = lambda: in_child(_check_as_nobody, target)  # noqa: E731
        else:
            call = lambda: check_nvme_path(target)  # noqa: E731
        with pytest.raises(AioError, match="is not writable") as info:
            call()
        assert info.value.errno in (errno.EACCES, errno.EPERM) and target in str(info.value)
    finally:
        os.chmod(target, 0o755)
        os.rmdir(target)


# ---------------------------------------------------------------------------------------------------
# Errors: short reads, wrong sizes, bad arguments


def test_short_read_and_wrong_size_are_errors_naming_file_offset_and_size(handle, tmp_path):
    with handle.open(tmp_path / "small", create=True) as f:
        handle.write(rand_bytes(8192), f)
        with pytest.raises(AioError, match=r"holds 8192 bytes; a read of 8192 bytes at offset 4096 "
                                           r"needs 12288") as info:
            handle.submit_read(aligned_empty(8192), f, 4096)
        assert info.value.filename == str(tmp_path / "small")
    # below the Python check: the C core reports a read past the end as a short read
    h = handle._handle
    buf = aligned_empty(16384)
    fd = os.open(tmp_path / "small", os.O_RDONLY)
    try:
        op = h.submit_read(fd, buf.data_ptr(), 16384, 0, buf)
    finally:
        os.close(fd)  # the op has its own descriptor
    res = h.wait(op)
    assert res is not None and res[0] == errno.ENODATA and res[1] is True
    exc = aio._op_error("read", str(tmp_path / "small"), 0, 16384, res)
    assert "short read" in str(exc) and "holds 8192 bytes, 16384 needed" in str(exc)
    with pytest.raises(ValueError, match="not pending"):
        h.wait(op)


def test_bad_arguments_are_refused_before_any_io(handle, tmp_path):
    f = handle.open(tmp_path / "args", create=True)
    with pytest.raises(ValueError, match="multiple of 4096"):
        handle.submit_write(rand_bytes(10), f, 100)
    unaligned = torch.empty(5000, dtype=torch.uint8)[1:]
    with pytest.raises(ValueError, match="not 4096-byte aligned, which O_DIRECT needs"):
        handle.submit_write(unaligned, f)
    with pytest.raises(ValueError, match="not contiguous"):
        handle.submit_write(aligned_empty((64, 64), torch.float32).t(), f)
    with pytest.raises(TypeError, match="torch.Tensor"):
        handle.submit_write(b"bytes", f)
    with pytest.raises(ValueError, match="on meta"):
        handle.submit_write(torch.empty(4, device="meta"), f)
    ro = handle.open(tmp_path / "args", write=False)
    with pytest.raises(ValueError, match="reading only"):
        handle.submit_write(rand_bytes(10), ro)
    f.close()
    ro.close()
    with pytest.raises(ValueError, match="closed SwapFile"):
        handle.submit_write(rand_bytes(10), f)
    with pytest.raises(AioError, match="cannot open swap file") as info:
        handle.submit_read(rand_bytes(10), tmp_path / "missing")
    assert info.value.errno == errno.ENOENT
    for bad in (dict(block_size=1000), dict(queue_depth=0), dict(intra_op_parallelism=0)):
        with pytest.raises(ValueError):
            AsyncIO(**bad)
    with pytest.raises(ValueError, match="backend must be"):
        _C.AioHandle(backend="fast")


def test_config_section_and_deepspeed_handle_calls(tmp_path, caplog):
    from zero_ext.config.aio import AioConfig
    from zero_ext.config.errors import ConfigError

    aio._said.clear()
    caplog.set_level(logging.WARNING, logger="zero_ext.aio")
    cfg = {"block_size": 1 << 16, "queue_depth": 4, "thread_count": 2, "single_submit": True,
           "overlap_events": False, "use_gds": True}
    with AsyncIO.from_config(cfg, backend="threads") as h:
        assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == (1 << 16, 4, 2)
        assert h.get_single_submit() and not h.get_overlap_events() and h.get_alignment() == 4096
        assert not h.use_gds and any("use_gds" in r.getMessage() for r in caplog.records)
        buf = h.new_cpu_locked_tensor(5000, torch.empty(0, dtype=torch.float16))
        assert buf.dtype == torch.float16 and aio.is_aligned(buf)
        buf.copy_(torch.arange(5000))
        assert h.async_pwrite(buf, str(tmp_path / "ds")) == 0 and h.wait() == 1
        back = h.new_cpu_locked_tensor(5000, buf)
        assert h.sync_pread(back, str(tmp_path / "ds")) == 1 and torch.equal(back, buf)
    assert AsyncIO.from_config(AioConfig(queue_depth=3), backend="threads").queue_depth == 3
    with AsyncIO.from_config({"queue_depth": 2, "block_size": "auto"}, backend="threads") as h:
        assert (h.block_size, h.queue_depth, h.intra_op_parallelism, h.overlap_events) == (1 << 20, 2, 1, True)
    with pytest.raises(ConfigError, match="queue_dept"):
        AsyncIO.from_config({"queue_dept": 2})


@pytest.mark.parametrize("backend", BACKENDS)
def test_use_after_fork_is_refused_and_dropping_the_copy_is_safe(backend, tmp_path):
    with AsyncIO(backend=backend) as h:
        h.write(rand_bytes(10), str(tmp_path / "fork"))
        with pytest.raises(RuntimeError, match="forked child"):
            in_child(h.submit_write, rand_bytes(10), str(tmp_path / "fork"))

        def drop_in_child():  # the parent's workers do not exist here: nothing may wait for them
            with pytest.raises(OSError) as info:
                h._handle.submit_write(0, 0, 0, 0, None)
            h.close()
            return info.value.errno

        assert in_child(drop_in_child) == errno.EOWNERDEAD
        h.write(rand_bytes(10), str(tmp_path / "fork"))  # the parent's handle still works


# ---------------------------------------------------------------------------------------------------
# Swap directories and the swapper


@pytest.mark.parametrize("backend", BACKENDS)
def test_swapper_round_trip_and_what_it_refuses(backend, tmp_path):
    with NVMeSwapper(tmp_path, {"queue_depth": 4, "block_size": 1 << 16}) as sw:
        assert sw.aio.backend in ("uring", "threads")
        run_dir = sw.dir.path
        assert os.path.dirname(run_dir) == str(tmp_path) and os.stat(run_dir).st_mode & 0o777 == 0o700
        a = aligned_empty(100_003, torch.float32).normal_()
        b = aligned_empty(7, torch.float16).normal_()
        sw.swap_out("a", a)
        sw.swap_out("b", b)
        assert sw.wait() == 2
        assert os.stat(sw.dir.file("a")).st_mode & 0o777 == 0o600
        a2, b2 = aligned_empty(100_003, torch.float32), aligned_empty(7, torch.float16)
        sw.swap_in("a", a2).wait()
        sw.swap_in("b", b2).wait()
        assert torch.equal(a2, a) and torch.equal(b2, b)
        a.mul_(2)
        sw.swap_out("a", a)  # rewrite, same size
        sw.swap_in("a", a2).wait()  # waits for the write first
        assert torch.equal(a2, a)
        with pytest.raises(KeyError, match="was swapped out by this run"):
            sw.swap_in("c", a2)
        with pytest.raises(ValueError, match="400012 bytes; 14 were"):
            sw.swap_in("b", a2)
        os.truncate(sw.dir.file("b"), 8192)
        with pytest.raises(AioError, match="changed outside zero_ext"):
            sw.swap_in("b", b2)
        with pytest.raises(ValueError, match="plain file name"):
            sw.swap_out("../escape", a)
        sw.remove("b")
        assert not os.path.exists(sw.dir.file("b"))
    assert not os.path.exists(run_dir)
    assert sw.aio.closed  # it made its AsyncIO, so it closed it


_LEFTOVER_SCRIPT = r"""
import os, sys, torch
from zero_ext.nvme.aio import aligned_empty
from zero_ext.nvme.swap_dir import SwapDir
from zero_ext.nvme.swapper import NVMeSwapper
root = sys.argv[1]
clean = NVMeSwapper(root, {"queue_depth": 2})
clean.swap_out("x", aligned_empty(10000).fill_(1)).wait()
pid = os.fork()
if pid == 0:  # a run that dies without cleaning up
    crashed = NVMeSwapper(root, {"queue_depth": 2})
    crashed.swap_out("x", aligned_empty(10000).fill_(2)).wait()
    print(crashed.dir.path, flush=True)
    os._exit(1)
os.waitpid(pid, 0)
print(clean.dir.path, flush=True)
# the interpreter exits normally: the clean run's directory goes with it
"""


def test_swap_dirs_go_at_clean_exit_and_leftovers_are_never_read(tmp_path, caplog):
    out = subprocess.run([sys.executable, "-c", _LEFTOVER_SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    crashed, clean = out.stdout.split()
    assert not os.path.exists(clean)
    assert os.path.isfile(os.path.join(crashed, "x"))  # the crash left its files
    live = SwapDir(tmp_path)  # a living run's directory is not touched by others
    caplog.set_level(logging.WARNING, logger="zero_ext.aio")
    with NVMeSwapper(tmp_path) as sw:
        assert not os.path.exists(crashed)  # reclaimed, with a warning
        assert any(crashed in r.getMessage() for r in caplog.records)
        assert os.path.isdir(live.path)
        with pytest.raises(KeyError):
            sw.swap_in("x", aligned_empty(10000))  # never read as state of this run
    live.destroy()
    assert os.listdir(tmp_path) == []


def _reap_forever(root, stop_at):
    from zero_ext.nvme.swap_dir import _reap_leftovers

    while time.time() < stop_at:
        _reap_leftovers(root)
    return True


def test_a_reaper_in_another_process_never_takes_a_live_swap_dir(tmp_path):
    """Two runs share nvme_path: one's start-up reaping must never remove the other's directory in the
    instant between its creation and its lock (seen once in CI as 'cannot create swap file')."""
    import multiprocessing

    from zero_ext.nvme.swap_dir import SwapDir

    ctx = multiprocessing.get_context("fork")
    stop_at = time.time() + 3.0
    reaper = ctx.Process(target=_reap_forever, args=(str(tmp_path), stop_at))
    reaper.start()
    lost = made = 0
    try:
        while time.time() < stop_at:
            d = SwapDir(tmp_path, check=False)
            made += 1
            with open(d.file("probe.swp"), "wb") as f:  # fails if the reaper removed the directory
                f.write(b"x")
            lost += not os.path.isfile(os.path.join(d.path, ".lock"))
            d.destroy()
    finally:
        reaper.join(10)
    assert made > 50 and lost == 0


# -- registered (fixed) buffers ---------------------------------------------------------------------

uring_only = pytest.mark.skipif(bool(URING_ERRNO), reason=URING_SKIP or "-")


@uring_only
def test_registered_buffers_move_the_same_bytes_through_fixed_requests(tmp_path):
    """Requests inside a registered tensor go through fixed-buffer I/O (counted), others as before;
    a request straddling two registered tensors is not inside either; bytes are right either way."""
    n = 1 << 20
    with AsyncIO(block_size=64 << 10, queue_depth=4, backend="uring") as h, \
            aio.SwapFile(str(tmp_path / "f"), create=True) as f:
        pool = rand_bytes(2 * n, seed=1)
        assert h.register_buffers([pool[:n], pool[n:]])  # two tensors sharing one allocation
        h.write(pool, f)  # 32 requests of 64 KiB, each inside one half
        assert h.fixed_requests == 32
        plain = aligned_empty(2 * n)
        h.read(plain, f)  # not registered
        assert h.fixed_requests == 32 and torch.equal(plain, pool)
        pool.zero_()
        h.read(pool[4096:4096 + n], f, 0)  # 16 requests; the last one straddles the halves
        assert h.fixed_requests == 32 + 15
        assert torch.equal(pool[4096:4096 + n], plain[:n])
        h.unregister_buffers([pool[n:]])
        h.read(pool[n:], f, n)
        assert h.fixed_requests == 47 and torch.equal(pool[n:], plain[n:])
        h.unregister_buffers()
        h.read(pool[:n], f)
        assert h.fixed_requests == 47 and torch.equal(pool[:n], plain[:n])


@uring_only
def test_registering_while_requests_are_in_flight(tmp_path):
    """Workers switch sets between requests: registering with many ops queued neither hangs nor
    moves a wrong byte, and the registered tensors are kept alive by the handle."""
    with AsyncIO(block_size=16 << 10, queue_depth=8, intra_op_parallelism=2, backend="uring") as h, \
            aio.SwapFile(str(tmp_path / "f"), create=True) as f:
        data = [rand_bytes(256 << 10, seed=s) for s in range(8)]
        reqs = [h.submit_write(t, f, i * (256 << 10)) for i, t in enumerate(data)]
        pool = aligned_empty(2 << 20)
        ref = weakref.ref(pool)
        assert h.register_buffers([pool])
        h.wait()
        assert all(r.done() for r in reqs)
        del pool
        assert ref() is not None  # the kernel holds its pages: so must we
        reqs = [h.submit_read(ref()[i * (256 << 10):(i + 1) * (256 << 10)], f, i * (256 << 10))
                for i in range(8)]
        assert h.register_buffers([aligned_empty(4096)])  # adds while the reads run
        h.wait()
        for i, t in enumerate(data):
            assert torch.equal(ref()[i * (256 << 10):(i + 1) * (256 << 10)], t)
        assert h.fixed_requests == 8 * 16  # the sets before and after the switch both hold the pool
    assert ref() is None  # closing lets it go


@uring_only
def test_registering_from_two_threads_at_once_never_hangs():
    """A later call's set may overtake an earlier one's before a worker takes it: neither call may
    wait for a set that no worker will ever report."""
    with AsyncIO(queue_depth=4, intra_op_parallelism=3, backend="uring") as h:
        bufs = [aligned_empty(8192) for _ in range(2)]
        errors = []

        def churn(buf):
            try:
                for _ in range(200):
                    h._handle.register_buffers([(buf.data_ptr(), 8192)], buf)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=churn, args=(b,), daemon=True) for b in bufs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "register_buffers hung"
        assert not errors


def test_thread_backend_registers_nothing(tmp_path):
    with AsyncIO(backend="threads") as h:
        assert h.register_buffers([aligned_empty(8192)]) is False
        assert h.fixed_requests == 0


@uring_only
@pytest.mark.skipif(not (os.path.exists("/usr/bin/setpriv") and os.path.exists("/usr/bin/prlimit")),
                    reason="needs util-linux's setpriv and prlimit")
def test_registration_refused_past_memlock_runs_unregistered_and_says_why(tmp_path):
    """Without CAP_IPC_LOCK and with a 1 MiB RLIMIT_MEMLOCK the kernel refuses a 4 MiB pool: the
    call says so once, and the I/O still moves the right bytes. (1 MiB, not less: the kernel charges a
    ring to the user's locked memory, which every process of this user without the capability shares.)"""
    code = (
        "import torch\n"
        "from zero_ext.nvme.aio import AsyncIO, SwapFile, aligned_empty\n"
        "h = AsyncIO(block_size=65536, backend='uring')\n"
        "pool = aligned_empty(4 << 20); pool.random_(0, 256)\n"
        "assert h.register_buffers([pool]) is False\n"
        "with SwapFile(%r, create=True) as f:\n"
        "    h.write(pool, f); back = aligned_empty(4 << 20); h.read(back, f)\n"
        "assert torch.equal(back, pool) and h.fixed_requests == 0\n"
        "assert h.register_buffers([aligned_empty(8192)])  # within the limit\n"
        "print('ok')\n" % str(tmp_path / "f"))
    out = subprocess.run(["/usr/bin/prlimit", "--memlock=1048576", "/usr/bin/setpriv", "--bounding-set",
                          "-ipc_lock", sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    if "setpriv" in out.stderr and out.returncode != 0 and "ok" not in out.stdout:
        pytest.skip(f"cannot drop CAP_IPC_LOCK here: {out.stderr.strip()[-200:]}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
    assert "refused to register 1 swap buffers of 4194304 bytes (ENOMEM)" in out.stderr
    assert "RLIMIT_MEMLOCK" in out.stderr
