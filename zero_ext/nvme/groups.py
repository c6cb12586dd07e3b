"""zero_ext.nvme.groups: the records of ``NVMeStateStore`` (store.py): where a group's data is
(``SwapState``), a group (its tensors, layout in the file and buffer, swap files), a pool buffer, and
the packing of a group's tensors into one buffer.

[Note: spare slots] A store made with ``spare_slot=True`` keeps two files per group: ``names[valid]``
holds the data last known good, every write-back goes to the other one, and ``valid`` moves to it only
when that write succeeded (at once, or inside a transaction at ``commit``). A failed write, or a
transaction rolled back, leaves ``names[valid]`` as it was.
"""
from __future__ import annotations

import enum
from typing import Iterable, List, Optional, Tuple

import torch

from .aio import AioError, AioRequest

TENSOR_ALIGN = 64  # bytes between the starts of a group's tensors in its file and buffer

class SwapState(enum.Enum):
    """Where a group's data is (docs/nvme.md, SwapState)."""
    ON_NVME = "on_nvme"            # valid in its file; tensors released (its buffer may hold a clean copy)
    SWAPPING_IN = "swapping_in"    # a buffer is taken and the read may be in flight
    IN_MEMORY = "in_memory"        # tensors are views of the buffer (resident)
    SWAPPING_OUT = "swapping_out"  # write-back in flight; tensors released; buffer busy until it ends
    INVALID = "invalid"            # the last write failed: the file holds no valid data


class PoolBuffer:
    __slots__ = ("data", "group")

    def __init__(self, data: torch.Tensor):
        self.data = data  # (buffer_bytes,) uint8, page-aligned
        self.group: Optional[SwapGroup] = None  # the group whose data it holds or will hold


class SwapGroup:
    __slots__ = ("key", "names", "valid", "newest", "tensors", "layout", "nbytes", "state", "buffer",
                 "request", "holds", "error", "last_use", "writing")

    def __init__(self, key, names: List[str], tensors: List[torch.Tensor], layout, nbytes: int):
        self.key, self.tensors = key, tensors
        self.names = names  # its swap files: one, or two with spare slots ([Note: spare slots])
        self.valid = 0  # the file holding the data last known good
        self.newest = 0  # the file holding the newest data (a transaction's write not yet committed)
        self.writing = 0  # the file of the write in flight or last submitted
        self.layout: List[Tuple[int, torch.Size, torch.dtype, int]] = layout  # (offset, shape, dtype, nbytes)
        self.nbytes = nbytes  # bytes of the packed group (the file holds round_up(nbytes))
        self.state = SwapState.ON_NVME
        self.buffer: Optional[PoolBuffer] = None
        self.request: Optional[AioRequest] = None
        self.holds = 0  # open resident()/stream() uses; written back when the last one ends
        self.error: Optional[AioError] = None
        self.last_use = 0

    @property
    def name(self) -> str:
        """The file a read takes the group from."""
        return self.names[self.newest]

    @property
    def spare(self) -> str:
        """The file the next write goes to: the one not holding the good data (the only one without
        spare slots)."""
        return self.names[1 - self.valid] if len(self.names) == 2 else self.names[0]


def pack_layout(specs: Iterable[Tuple[torch.Size, torch.dtype]]):
    """[(offset, shape, dtype, nbytes)] for tensors packed at TENSOR_ALIGN, and the total bytes."""
    out, offset = [], 0
    for shape, dtype in specs:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append((offset, torch.Size(shape), dtype, nbytes))
        offset += -(-nbytes // TENSOR_ALIGN) * TENSOR_ALIGN
    total = out[-1][0] + out[-1][3] if out else 0
    return out, total


def group_views(buffer: torch.Tensor, layout) -> List[torch.Tensor]:
    return [buffer[off:off + n].view(dtype).view(shape) for off, shape, dtype, n in layout]


def zero_gaps(buffer: torch.Tensor, layout) -> None:
    """Zeroes the padding between tensors before a group's first write, so a file holds only its
    group's bytes (not what a reused buffer held) and is the same whichever path wrote it. Reads
    fill the gaps from the file, so they stay zero."""
    for (off, _, _, n), nxt in zip(layout, layout[1:]):
        buffer[off + n:nxt[0]].zero_()
