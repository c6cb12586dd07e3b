"""NVMeStateStore (zero_ext/nvme/store.py): groups of tensors on real swap files of the local disk.

Every test runs on both aio backends where it matters (io_uring skips, with the kernel's reason,
where this process may not use it). The full-drive test mounts a 1 MiB tmpfs and skips where mount
is not permitted; a failing write-back is made real by putting a read-only descriptor under the
group's file (the kernel then refuses the write with EBADF).
"""
import errno
import gc
import os

import pytest
import torch

from zero_ext import _C
from zero_ext.nvme import store as nvme_states
from zero_ext.nvme.aio import AioError
from zero_ext.nvme.store import NVMeStateStore, SwapState

from helpers.fs import in_child, mount

URING_ERRNO = _C.aio_uring_probe()
BACKENDS = [pytest.param("uring", marks=pytest.mark.skipif(
    bool(URING_ERRNO), reason=f"io_uring refused by this kernel: {os.strerror(URING_ERRNO or 1)}")),
    "threads"]
AIO = {"block_size": 64 << 10, "queue_depth": 4}


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("ZERO_EXT_AIO", request.param)  # what choose_backend reads
    return request.param


@pytest.fixture
def store(tmp_path, backend):
    s = NVMeStateStore(tmp_path, buffer_count=3, aio=AIO)
    assert s.aio.backend == backend
    yield s
    s.destroy()


def make_groups(seed=0):
    """Groups shaped like optimizer sub-groups (master, exp_avg, exp_avg_sq) of awkward sizes, plus
    one of mixed dtypes: sizes not multiples of 4096 bytes, a 1-element group, a 2-D tensor."""
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 1023, 4097, 70_001, 3]
    groups = {f"sub{i}": [torch.randn(n, generator=g) for _ in range(3)] for i, n in enumerate(sizes)}
    groups["mixed"] = [torch.randn(7, 13, generator=g), torch.randn(5, generator=g).to(torch.bfloat16),
                       torch.randint(-9, 9, (3,), generator=g, dtype=torch.int64), torch.empty(0)]
    master = torch.nn.Parameter(torch.randn(9, generator=g))  # a master with its gradient set
    master.grad = torch.randn(9, generator=g)
    groups["param"] = [master]
    return groups


def clone(groups):
    return {k: [t.clone() for t in v] for k, v in groups.items()}


def assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))  # bit for bit


# ---------------------------------------------------------------------------------------------------
# Round trips and identity


def test_round_trip_bit_for_bit_keeps_identity_and_releases_storage(store):
    groups = make_groups()
    ref = clone(groups)
    ids = {k: [id(t) for t in v] for k, v in groups.items()}
    by_tensor = {t: (k, i) for k, v in groups.items() for i, t in enumerate(v)}  # like optimizer.state
    for k, v in groups.items():
        store.register(k, v)
    for k, v in groups.items():
        assert all(t.numel() == 0 for t in v), "registered tensors keep their storage"
        assert store.state(k) == SwapState.ON_NVME
    for k in reversed(list(groups)):  # random access, more groups than buffers
        with store.resident(k, modified=False) as tensors:
            assert [id(t) for t in tensors] == ids[k] and tensors == groups[k]
            for i, (t, r) in enumerate(zip(tensors, ref[k])):
                assert_same(t, r)
                assert by_tensor[t] == (k, i)
            assert store.state(k) == SwapState.IN_MEMORY
        assert all(t.numel() == 0 for t in groups[k])
    assert set(store.keys()) == set(groups) and len(store) == len(groups)


def test_sizes_and_pool_is_allocated_once(store):
    groups = make_groups()
    for k, v in groups.items():
        store.register(k, v)
    biggest = max(NVMeStateStore.group_nbytes([(t.shape, t.dtype) for t in v])
                  for v in make_groups().values())
    assert store.host_bytes() == 3 * -(-biggest // 4096) * 4096
    files = [os.path.join(store.swapper.dir.path, f) for f in os.listdir(store.swapper.dir.path)
             if f.endswith(".swp")]
    assert store.nvme_bytes() == sum(os.path.getsize(f) for f in files) and len(files) == len(groups)
    pool = [b.data.data_ptr() for b in store._buffers]
    for _ in range(2):
        for k in store.stream(groups, pipeline_read=True, pipeline_write=True):
            lo, hi = min(pool), max(pool) + store._buffer_bytes
            assert all(lo <= t.data_ptr() < hi for t in groups[k] if t.numel()), "not in the pool"
    assert [b.data.data_ptr() for b in store._buffers] == pool
    # with io_uring the pool is registered: its reads and writes are fixed-buffer requests
    assert (store.aio.fixed_requests > 0) == (store.aio.backend == "uring")


def test_pool_registration_follows_resizing_and_destroy(tmp_path, backend):
    """A pool that grows is unregistered before it is freed and the new one registered; destroy
    unregisters it from an AsyncIO the store was given (and does not own)."""
    from zero_ext.nvme.aio import AsyncIO

    with AsyncIO(**AIO) as aio:
        s = NVMeStateStore(tmp_path, buffer_count=2, aio=aio)
        s.register("small", [torch.randn(100)])
        first = {b.data.data_ptr() for b in s._buffers}
        assert set(aio._registered) == (first if backend == "uring" else set())
        s.register("big", [torch.randn(200_000)])  # the pool grows
        second = {b.data.data_ptr() for b in s._buffers}
        assert set(aio._registered) == (second if backend == "uring" else set())
        with s.resident("big") as (t,):
            t.add_(1)
        s.destroy()
        assert aio._registered == {} and not aio.closed


# ---------------------------------------------------------------------------------------------------
# stream()


@pytest.mark.parametrize("pipeline_read", [False, True])
@pytest.mark.parametrize("pipeline_write", [False, True])
@torch.no_grad()  # as an optimizer step runs
def test_stream_in_place_updates_match_memory_with_every_pipeline(store, pipeline_read, pipeline_write):
    groups = make_groups()
    expect = clone(groups)
    for k, v in groups.items():
        store.register(k, v)
    keys = list(groups)
    for step in range(2):
        seen = []
        for j, key in enumerate(store.stream(keys, pipeline_read, pipeline_write)):
            seen.append(key)
            later = keys[j + 1] if j + 1 < len(keys) else None
            if later is not None:  # the next read is in flight only when asked for
                assert (store.state(later) == SwapState.SWAPPING_IN) == pipeline_read
            if not pipeline_read and not pipeline_write:
                assert store.aio.pending == 0, "strict read -> yield -> write has no I/O in flight"
            for i, t in enumerate(groups[key]):
                if t.is_floating_point():
                    t.mul_(2).add_(j + i)
                else:
                    t.add_(step)
        assert seen == keys
        assert all(store.state(k) == SwapState.ON_NVME for k in keys) and store.aio.pending == 0
        for j, key in enumerate(keys):
            for i, t in enumerate(expect[key]):
                if t.is_floating_point():
                    t.mul_(2).add_(j + i)
                else:
                    t.add_(step)
    for k in keys:
        with store.resident(k) as tensors:
            for t, r in zip(tensors, expect[k]):
                assert_same(t, r)


def test_buffer_count_is_checked_with_the_config_key(tmp_path):
    with pytest.raises(ValueError, match="offload_optimizer.buffer_count"):
        NVMeStateStore(tmp_path, buffer_count=0)
    with NVMeStateStore(tmp_path, buffer_count=1, aio=AIO) as one, \
            NVMeStateStore(tmp_path, buffer_count=2, aio=AIO) as two:
        for s in (one, two):
            for k in "abc":
                s.register(k, [torch.ones(5)])
        for flags in ((True, False), (False, True)):
            with pytest.raises(ValueError, match=r"offload_optimizer.buffer_count >= 2.*it is 1"):
                one.stream(["a", "b"], *flags)
        with pytest.raises(ValueError, match=r"pipeline_read and pipeline_write need "
                                             r"offload_optimizer.buffer_count >= 3"):
            two.stream(["a", "b", "c"], True, True)
        list(one.stream(["a", "b"]))  # one buffer is enough without pipelining
        list(one.stream(["a"], True, True))  # and for a single group, whatever the pipelining
        list(two.stream(["a", "b"], True, True))  # each buffer in use holds a different group
        # every buffer held by a group in use: a clear error, not a deadlock
        with pytest.raises(RuntimeError, match="raise offload_optimizer.buffer_count"):
            for _ in two.stream(["a", "b"], pipeline_read=True):  # "a" in hand, "b" being read
                with two.resident("c"):
                    pass


def test_nested_resident_and_leaving_a_stream_early(store):
    groups = {k: [torch.full((100,), float(i))] for i, k in enumerate("abcd")}
    for k, v in groups.items():
        store.register(k, v)
    for key in store.stream("abcd", pipeline_read=True, pipeline_write=True):
        with store.resident(key) as (t,):  # the group in hand: shared, written once by the stream
            t.add_(1)
        if key == "b":
            break
    # the generator was closed by the break: "b" written back, "c"'s prefetch settled
    assert all(store.state(k) == SwapState.ON_NVME for k in "abcd") and store.aio.pending == 0
    for k, want in zip("abcd", (1, 2, 2, 3)):
        with store.resident(k, modified=False) as (t,):
            assert torch.equal(t, torch.full((100,), float(want)))
    with store.resident("a", modified=False) as (t,):
        t.fill_(-1)  # broken promise: not written, and not kept in the pool either
    with store.resident("a") as (t,):
        assert t[0] == 1


def test_unknown_keys_and_replaced_storage_are_errors(store):
    store.register("a", [torch.ones(10)])
    with pytest.raises(KeyError, match="no group 'nope'"):
        with store.resident("nope"):
            pass
    with pytest.raises(KeyError, match="no group 'nope'"):
        store.stream(["a", "nope"])  # before any I/O
    with pytest.raises(ValueError, match="already registered"):
        store.register("a", [torch.ones(1)])
    with pytest.raises(ValueError, match="already in group 'a'"):
        store.register("b", store.tensors("a"))
    with pytest.raises(ValueError, match="on meta"):
        store.register("b", [torch.ones(1, device="meta")])
    with pytest.raises(ValueError, match="given new storage"):
        with store.resident("a") as (t,):
            t.data = torch.zeros(10)
    with pytest.raises(AioError, match="'a' has no valid data on NVMe: tensor 0 was given new "
                                       "storage while resident, so the update was not written back"):
        with store.resident("a"):
            pass


# ---------------------------------------------------------------------------------------------------
# fast_init


@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16])
def test_register_from_lp_equals_the_fp32_path_bit_for_bit(tmp_path, lp_dtype, monkeypatch):
    monkeypatch.setattr(nvme_states, "LP_CHUNK", 1000)  # many chunks per tensor
    g = torch.Generator().manual_seed(1)
    lps = [torch.randn(n, generator=g).to(lp_dtype) for n in (4097, 1)] + \
          [torch.randn(33, 31, generator=g).to(lp_dtype)]
    lps.append(torch.randn(2000, generator=g).to(lp_dtype)[::2])  # not contiguous
    state_numels = [4097, 1, 33 * 31, 1000, (33, 31)]
    with NVMeStateStore(tmp_path, 2, aio=AIO) as fast, NVMeStateStore(tmp_path, 2, aio=AIO) as slow:
        made = fast.register_from_lp("g", lps, state_numels)
        slow.register("g", [lp.float() for lp in lps] +
                      [torch.zeros(n if isinstance(n, tuple) else (n,)) for n in state_numels])
        assert len(made) == 9 and all(t.numel() == 0 and t.dtype == torch.float32 for t in made)
        assert made[2].shape == (0,) and fast.tensors("g") == made
        with fast.resident("g") as a, slow.resident("g") as b:
            assert a[2].shape == (33, 31) and a[-1].shape == (33, 31) and a[5].shape == (1,)
            for x, y in zip(a, b):
                assert_same(x, y)
        files = [open(os.path.join(s.swapper.dir.path, "group00001.swp"), "rb").read()
                 for s in (fast, slow)]
        assert files[0] == files[1]


# ---------------------------------------------------------------------------------------------------
# Failures


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_full_drive_names_bytes_and_earlier_groups_survive(tmp_path, backend_name, mounts,
                                                           monkeypatch):
    monkeypatch.setenv("ZERO_EXT_AIO", backend_name)
    target = mount(tmp_path, "tmpfs", "size=1m")
    mounts.append(target)
    with NVMeStateStore(target, buffer_count=2, aio=AIO) as store:
        quarter = 60_000  # floats: 240 KB a group, 4 do not fit in 1 MiB
        groups, errors = {}, []
        for i in range(5):
            t = torch.arange(quarter, dtype=torch.float32) + i
            try:
                store.register(i, [t])
                groups[i] = t
            except AioError as exc:
                errors.append(exc)
                assert torch.equal(t, torch.arange(quarter, dtype=torch.float32) + i), "tensor lost"
                assert i not in store
        assert errors and len(groups) >= 2
        exc = errors[0]
        assert exc.errno == errno.ENOSPC
        assert "bytes needed" in str(exc) and "bytes free" in str(exc) and str(target) in str(exc)
        for k in store.stream(groups, pipeline_read=True):
            groups[k].add_(1)
        for k, t in groups.items():
            with store.resident(k) as (back,):
                assert back is t and torch.equal(t, torch.arange(quarter, dtype=torch.float32) + k + 1)


def test_failed_write_back_makes_the_group_invalid(store):
    store.register("bad", [torch.ones(5000)])
    store.register("good", [torch.full((5000,), 2.0)])
    path = store.swapper._files[store._groups["bad"].name]
    ro = os.open(path.path, os.O_RDONLY)
    os.dup2(ro, path.fd)  # the kernel now refuses every write to this file: EBADF
    os.close(ro)
    with pytest.raises(AioError) as info:
        with store.resident("bad") as (t,):
            t.add_(1)
    assert info.value.errno == errno.EBADF and path.path in str(info.value)
    assert store.state("bad") == SwapState.INVALID
    with pytest.raises(AioError, match="'bad' has no valid data on NVMe: its last write failed"):
        with store.resident("bad"):
            pass
    with pytest.raises(AioError, match="no valid data"):
        list(store.stream(["good", "bad"]))
    # the other group is intact
    with store.resident("good") as (t,):
        assert torch.equal(t, torch.full((5000,), 2.0))


def test_failed_read_raises_and_never_serves_the_buffer(store):
    for k in "abcd":  # four groups, three buffers: "a" is no longer in the pool
        store.register(k, [torch.full((3000,), 1.0)])
    path = os.path.join(store.swapper.dir.path, store._groups["a"].name)
    os.truncate(path, 4096)
    for _ in range(2):  # the second try must not take the buffer of the first for a clean copy
        with pytest.raises(AioError, match="changed outside zero_ext"):
            with store.resident("a"):
                pass
        assert store.state("a") == SwapState.ON_NVME
    with store.resident("d") as (t,):
        assert torch.equal(t, torch.full((3000,), 1.0))


def _stream_over_rlimit(root, backend, pipeline_write):
    """In a child: "bad" (2 MiB) is registered, then RLIMIT_FSIZE drops to 1 MiB, so its write-back
    is accepted and then fails in the kernel (EFBIG) while "good" (small) keeps working."""
    import resource
    import signal

    os.environ["ZERO_EXT_AIO"] = backend
    store = NVMeStateStore(root, buffer_count=3, aio=AIO)
    store.register("bad", [torch.ones(1 << 19)])
    store.register("good", [torch.full((5000,), 2.0)])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    stepped, err = [], None
    try:
        for key in store.stream(["bad", "good"], pipeline_read=True, pipeline_write=pipeline_write):
            store.tensors(key)[0].add_(1)
            stepped.append(key)
    except AioError as exc:
        err = (exc.errno, str(exc))
    states = [store.state(k) for k in ("bad", "good")]
    with store.resident("good") as (t,):
        good = t[0].item()
    try:
        with store.resident("bad"):
            pass
        again = None
    except AioError as exc:
        again = str(exc)
    store.destroy()
    return stepped, err, states, good, again


@pytest.mark.parametrize("pipeline_write", [False, True])
def test_write_failing_in_flight_during_a_stream(tmp_path, backend, pipeline_write):
    stepped, err, states, good, again = in_child(_stream_over_rlimit, str(tmp_path), backend,
                                                 pipeline_write)
    assert err is not None and err[0] == errno.EFBIG and "group00001.swp" in err[1], err
    # without pipeline_write the stream stops at the failed write; with it, at the loop's end
    assert stepped == (["bad", "good"] if pipeline_write else ["bad"])
    assert states == [SwapState.INVALID, SwapState.ON_NVME]
    assert good == (3.0 if pipeline_write else 2.0)
    assert again is not None and "'bad' has no valid data" in again


# ---------------------------------------------------------------------------------------------------
# Lifetime


def test_destroy_removes_files_and_is_idempotent(tmp_path):
    store = NVMeStateStore(tmp_path, 2, aio=AIO)
    t = torch.ones(3)
    store.register("a", [t])
    path = store.swapper.dir.path
    assert os.listdir(path)
    store.destroy()
    store.destroy()
    assert not os.path.exists(path) and t.numel() == 0
    with pytest.raises(RuntimeError, match="destroyed"):
        store.resident("a").__enter__()
    dropped = NVMeStateStore(tmp_path, 2, aio=AIO)
    dropped.register("a", [torch.ones(3)])
    path = dropped.swapper.dir.path
    del dropped
    gc.collect()
    assert not os.path.exists(path), "dropping the store leaves its swap files"


def test_in_memory_holds_more_groups_than_buffers_and_writes_back(store):
    groups = {k: [torch.full((1000 + k,), float(k)), torch.full((7,), -float(k))] for k in range(5)}
    for k, ts in groups.items():
        store.register(k, ts)
    with store.in_memory(range(5)):  # 5 groups, 3 buffers: ordinary memory, not the pool
        assert all(t.numel() > 0 for ts in groups.values() for t in ts)
        with store.resident(2) as shared:  # a held group is shared, not read again
            shared[0].add_(1)
        groups[4][1].data = torch.full((7,), 99.0)  # new storage of the same shape is taken too
    assert all(t.numel() == 0 for ts in groups.values() for t in ts)  # released after the block
    with store.in_memory([2, 4], modified=False):
        assert torch.equal(groups[2][0], torch.full((1002,), 3.0))
        assert torch.equal(groups[4][1], torch.full((7,), 99.0))
        groups[2][0].zero_()  # not written back: modified=False
    with store.resident(2) as (first, _):
        assert torch.equal(first, torch.full((1002,), 3.0))
