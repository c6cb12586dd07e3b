"""Peak host memory of one rank while a model is built under zero.Init (fresh processes).

Bound (issue 6): a rank's pieces of the whole model, plus the largest single module's own parameters
(the module under construction, whole until its constructor returns), plus a fixed overhead. The model
is several times larger than that bound, so a construction that kept the model whole, or that
partitioned only at Init's exit, would fail.

Measured as resident memory: the kernel's high-water mark (VmHWM) is reset just before construction
(``/proc/self/clear_refs``), and glibc is told to return every allocation over 64 KiB to the kernel
when freed (``mallopt(M_MMAP_THRESHOLD)``), so that RSS follows the live tensors. The workers are a
new pool: no earlier test's allocations linger in them.
"""
import sys

import pytest
import torch
from torch import nn

from helpers.harness import WorkerPool

WORLD = 4
D = 768  # each layer's weight: 2.25 MiB in fp32
LAYERS = 32  # 72 MiB in all
MiB = 1 << 20
OVERHEAD = 6 * MiB  # measured: about 0.2 MiB


class Tall(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(LAYERS)])


class TallPostInit(Tall):
    """Initialises every finished layer again at the end of its constructor, as transformers'
    post_init does: each write gathers one parameter, which is partitioned again before the next."""

    def __init__(self):
        super().__init__()
        for layer in self.layers:
            nn.init.xavier_uniform_(layer.weight)
            layer.bias.data.zero_()


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_during_init(cls):
    import ctypes

    import zero_ext.zero as zero

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: large frees go back to the kernel
    with zero.Init():  # warm up code paths and the process group's buffers
        nn.Linear(64, 64)
    # and every page of the native transport's shared segment (in each rank's RSS once touched): an
    # all-gather of two 4 MiB slots' worth per rank writes and reads both slot sets
    from zero_ext import comm

    n = 2 * (4 << 20) // 4
    comm.all_gather_into(torch.empty(WORLD * n), torch.zeros(n))
    torch.manual_seed(torch.distributed.get_rank())
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    with zero.Init():
        model = cls()
    peak = _status("VmHWM") - base
    share = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    full = sum(p.ds_numel * 4 for p in model.parameters())
    largest = max(sum(p.ds_numel * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    # the control: the same measurement sees a plain construction hold the whole model
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    plain = cls()
    plain_peak = _status("VmHWM") - base
    del plain
    return peak, share, full, largest, plain_peak


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux only)")
@pytest.mark.parametrize("cls", [Tall, TallPostInit], ids=["construction", "writes after partitioning"])
def test_peak_memory_while_constructing_under_init(cls):
    pool = WorkerPool(WORLD)
    try:
        results = pool.run(_peak_during_init, (cls,), timeout=120)
    finally:
        pool.close()
    for r, (peak, share, full, largest, plain_peak) in enumerate(results):
        bound = share + largest + OVERHEAD
        assert full >= 2.5 * bound, "the model must be several times the bound for the test to mean anything"
        assert plain_peak >= full, f"rank {r}: the measurement missed a plain construction ({plain_peak / MiB:.1f} MiB)"
        assert peak <= bound, (f"rank {r}: peak {peak / MiB:.1f} MiB > pieces {share / MiB:.1f} + largest module "
                               f"{largest / MiB:.1f} + overhead {OVERHEAD / MiB:.0f} MiB (model {full / MiB:.0f} MiB)")
