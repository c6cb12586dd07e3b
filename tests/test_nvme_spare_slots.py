"""NVMeStateStore with spare_slot=True (zero_ext/nvme/groups.py, [Note: spare slots]): two files per
group, the second reserved at register; begin / commit / rollback make a set of write-backs all or
nothing. A failing write is made real by putting a read-only descriptor under the group's spare file
(the kernel then refuses the write with EBADF); a full drive by a 1 MiB tmpfs."""
import errno
import os

import pytest
import torch

from zero_ext.nvme.aio import AioError
from zero_ext.nvme.store import NVMeStateStore, SwapState

from helpers.fs import mount

AIO = {"block_size": 64 << 10, "queue_depth": 4}


def _values(store, keys):
    out = {}
    for k in keys:
        with store.resident(k, modified=False) as tensors:
            out[k] = [t.clone() for t in tensors]
    return out


def _swap_files(store):
    return [f for f in os.listdir(store.swapper.dir.path) if f.endswith(".swp")]


def _break_spare(store, key):
    """The next write to group ``key``'s spare file fails (EBADF); returns a function that mends it."""
    f = store.swapper._files[store._groups[key].spare]
    saved, ro = os.dup(f.fd), os.open(f.path, os.O_RDONLY)
    os.dup2(ro, f.fd)
    os.close(ro)

    def mend():
        os.dup2(saved, f.fd)
        os.close(saved)
    return mend


def test_a_transaction_is_all_or_nothing(tmp_path):
    g = torch.Generator().manual_seed(0)
    start = {k: [torch.randn(n, generator=g) for _ in range(3)] for k, n in (("a", 1000), ("b", 5000), ("c", 3))}
    keys = list(start)
    with NVMeStateStore(tmp_path, buffer_count=3, aio=AIO, spare_slot=True) as store:
        for k, tensors in start.items():
            store.register(k, [t.clone() for t in tensors])
        assert store.nvme_bytes() == sum(os.path.getsize(os.path.join(store.swapper.dir.path, f))
                                         for f in os.listdir(store.swapper.dir.path) if f.endswith(".swp"))
        assert len(_swap_files(store)) == 2 * len(keys)  # each group's spare, reserved

        store.begin()
        for k in store.stream(keys, pipeline_read=True, pipeline_write=True):
            for t in store.tensors(k):
                t.add_(1)
        store.commit()
        one = _values(store, keys)
        assert all(torch.equal(one[k][i], start[k][i] + 1) for k in keys for i in range(3))

        mend = _break_spare(store, "b")  # "a" is written, "b" fails, "c" may or may not be written
        store.begin()
        with pytest.raises(AioError) as info:
            for k in store.stream(keys, pipeline_read=True):
                for t in store.tensors(k):
                    t.add_(1)
        assert info.value.errno == errno.EBADF
        store.rollback()
        assert [store.state(k) for k in keys] == [SwapState.ON_NVME] * 3 and not store.in_transaction
        _same(_values(store, keys), one)  # every group as committed, "a" (written) and "b" (failed) included

        mend()
        store.begin()
        for k in store.stream(keys):
            for t in store.tensors(k):
                t.add_(1)
        store.commit()
        two = _values(store, keys)
        assert all(torch.equal(two[k][i], one[k][i] + 1) for k in keys for i in range(3))


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert all(torch.equal(x, y) for x, y in zip(a[k], b[k])), k


def test_writes_outside_a_transaction_keep_the_last_good_file(tmp_path):
    """Without a transaction a write becomes the good data when it succeeds; one that fails leaves the
    group invalid (its update is lost, and says so), with the file written before untouched."""
    with NVMeStateStore(tmp_path, buffer_count=2, aio=AIO, spare_slot=True) as store:
        store.register("g", [torch.zeros(2000)])
        first = store._groups["g"].names[0]
        with store.resident("g") as (t,):
            t.fill_(3)
        assert store._groups["g"].valid == 1  # the spare holds the newest good data now
        _break_spare(store, "g")  # the next write goes to the first file again, and fails
        with pytest.raises(AioError):
            with store.resident("g") as (t,):
                t.fill_(4)
        assert store.state("g") == SwapState.INVALID
        with pytest.raises(RuntimeError, match="commit of NVMe groups"):
            store.begin()
            store._txn["g"] = store._groups["g"]  # (a commit of a group whose write failed is refused)
            store.commit()
        assert store.state("g") == SwapState.ON_NVME and _values(store, ["g"])["g"][0].eq(3).all()
        assert store._groups["g"].name != first


def test_spare_files_are_reserved_at_register_so_a_small_drive_fails_there(tmp_path, mounts):
    target = mount(tmp_path, "tmpfs", "size=1m")
    mounts.append(target)
    with NVMeStateStore(target, buffer_count=2, aio=AIO, spare_slot=True) as store:
        registered, errors = [], []
        for i in range(4):  # 240 KB a group, 480 KB with its spare: the third does not fit
            t = torch.full((60_000,), float(i))
            try:
                store.register(i, [t])
                registered.append(i)
            except AioError as exc:
                errors.append(exc)
                assert t.eq(i).all() and i not in store, "the tensor is left as it was"
        assert registered == [0, 1] and errors and errors[0].errno == errno.ENOSPC, (registered, errors)
        assert len(_swap_files(store)) == 4  # the failed groups left no file behind


def test_a_group_without_a_spare_written_in_a_rolled_back_transaction_is_invalid(tmp_path):
    with NVMeStateStore(tmp_path, buffer_count=2, aio=AIO) as store:
        store.register("plain", [torch.ones(100)])
        store.register("spared", [torch.ones(100)], spare_slot=True)
        assert len(_swap_files(store)) == 3
        store.begin()
        for k in store.stream(["plain", "spared"]):
            store.tensors(k)[0].add_(1)
        store.rollback()
        assert store.state("spared") == SwapState.ON_NVME and _values(store, ["spared"])["spared"][0].eq(1).all()
        assert store.state("plain") == SwapState.INVALID
        with pytest.raises(AioError, match="written in place in a transaction that was rolled back"):
            _values(store, ["plain"])
