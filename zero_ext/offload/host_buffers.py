"""zero_ext.offload.host_buffers: how the engine allocates large host tensors.

- ``aligned_empty``: page-aligned buffers for O_DIRECT I/O, from 2 MiB up on transparent huge pages.
- ``host_empty``: long-lived large state (offloaded masters, gradient partitions, CPU optimizer
  state) on huge pages, each tensor on its own cache colour (see COLOURS).

No dependency on the C extension: anything may import it.
"""
from __future__ import annotations

import itertools
import math
import mmap

import torch

ALIGN = 4096  # bytes: file offsets, block sizes and O_DIRECT buffers are multiples of it
HUGE_PAGE = 2 << 20


def aligned_empty(shape, dtype: torch.dtype = torch.uint8, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on a 4096-byte boundary, as O_DIRECT needs.

    From 2 MiB up it is an anonymous mapping of its own, aligned to 2 MiB and advised to use
    transparent huge pages: every request then pins a few large pages instead of 256 small ones per
    MiB, and the device gets fewer, longer segments (on our disk +8% at 1 MiB blocks, up to +35% at
    256 KiB). The mapping is unmapped when the last tensor using it goes. ``pin_memory``: CUDA
    page-locked memory instead (no huge pages)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes >= HUGE_PAGE and not pin_memory:
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
        start = -base % HUGE_PAGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mm.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
            except OSError:
                pass  # THP off in this kernel: small pages work too
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=start)
        return raw.view(dtype).view(shape)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + nbytes].view(dtype).view(shape)


# Successive large host tensors start at successive offsets (colours) within a 4 KiB page. A
# kernel walks param, grad, exp_avg and exp_avg_sq at equal indices; were they all page-aligned, each
# step would touch the same cache sets of every array at once (the C Adam step ran 5-15 % slower at
# 1e8 elements with all four on one colour than with each on its own; benchmarks/bench_cpu_adam.py).
COLOUR_BYTES = 512
COLOURS = 8
_next_colour = itertools.count()


def host_empty(shape, dtype: torch.dtype = torch.float32, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised host tensor for long-lived, large state (offloaded masters, gradients, CPU
    optimizer state). From 2 MiB up it starts at the next of COLOURS offsets of COLOUR_BYTES in its
    page (see above; so it is not page-aligned: O_DIRECT I/O goes through aligned_empty buffers),
    and is on transparent huge pages as aligned_empty makes them (a pass over 4 KiB pages adds a TLB
    miss every 4 KiB of each array: the C Adam step ran ~10 % slower there); ``pin_memory``: in CUDA
    page-locked memory instead (4 KiB pages, coloured all the same). Below 2 MiB an ordinary tensor."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    colour = next(_next_colour) % COLOURS * COLOUR_BYTES
    raw = aligned_empty(colour + nbytes, torch.uint8, pin_memory=pin_memory)
    return raw[colour:colour + nbytes].view(dtype).view(shape)


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN == 0
