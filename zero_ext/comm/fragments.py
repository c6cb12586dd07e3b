"""One parameter's fragments across the ranks of a group: the data path of the state routines
(utils/safe_state.py's safe_get / safe_set), in C (csrc/comm_state.c).

A parameter's elements are cut into per-rank fragments that tile it in rank order (``FLAT``: stages 0-2,
the parameter's overlap with each rank's partition of its group's flat buffer; ``SHARDS``: stage 3,
shards of ceil(numel / N) whose tails are padding). ``Fragments`` holds that map (computed by C) and
moves fp32 state through it:

- ``gather``: the full parameter from every rank's fragment, an all-gather-v that moves only the real
  bytes (collective), each element then divided by the loss scale where asked;
- ``scatter``: this rank's run of a full value (every rank passes the same) into its fragment, times a
  factor: no communication;
- ``read_local`` / ``write_local``: the local forms, copies of this rank's fragment.

CPU fp32 tensors of a group the native transport carries run in C; anything else (CUDA tensors,
``ZERO_EXT_COMM=torch``, ranks on several hosts, other dtypes) takes the same steps in torch over the
facade's all_gather_v. Both give the same bits: one copy per element, one IEEE division or
multiplication by the same fp32 scale.
"""
import torch

from .. import _C
from . import native as _native
from .collectives import all_gather_v

FLAT, SHARDS = 0, 1  # csrc/comm.h's zx_frag_layout
_COPY, _DIVIDE, _MULTIPLY = 0, 1, 2


def _in_c(*tensors) -> bool:
    """Whether the C routines take these tensors: CPU, fp32, contiguous."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


class Fragments:
    """Where each rank's fragment of one parameter lies: ``counts[r]`` real elements, at ``param_at[r]``
    in the parameter and ``part_at[r]`` in rank r's partition. ``world`` is the layout's (1 for state
    every rank holds whole: stage 0); ``local_length`` is this rank's local form (stage 3: the whole
    padded shard, as DeepSpeed's ``ds_tensor``; else its real elements)."""

    def __init__(self, layout: int, numel: int, offset: int, part: int, world: int, rank: int, group=None):
        self.layout, self.numel, self.offset, self.part = layout, numel, offset, part
        self.world, self.rank, self.group = world, rank, group
        self.counts, self.param_at, self.part_at = _C.frag_map(layout, numel, offset, part, world)
        self.length = self.counts[rank]
        self.local_length = part if layout == SHARDS else self.length

    def _native(self):
        return _native.for_group(self.group) if self.world > 1 else None

    # --- full forms ------------------------------------------------------------------------------

    def gather(self, partition: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
        """The full parameter (1-D, ``numel`` fp32, on partition's device) from every rank's fragment,
        divided by ``divisor``. Collective when the layout has several ranks."""
        out = torch.empty(self.numel, dtype=torch.float32, device=partition.device)
        native = self._native()
        if _in_c(partition) and (self.world == 1 or native is not None):
            _C.frag_gather(native.comm if native is not None else None, self.layout, self.numel, self.offset,
                           self.part, partition.data_ptr(), out.data_ptr(), float(divisor))
            return out
        mine = self.real(partition).float()
        if self.world == 1:
            out.zero_()[self.param_at[0]:self.param_at[0] + self.length] = mine
        else:
            all_gather_v(out, mine, self.counts, self.group)
        return out / divisor if divisor != 1.0 else out

    def scatter(self, full: torch.Tensor, partition: torch.Tensor, factor: float = 1.0) -> None:
        """This rank's run of ``full`` (the whole parameter, any shape), times ``factor``, into its
        fragment of ``partition``. Local: every rank passes the same value."""
        flat = full.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"the value has {flat.numel()} elements, the parameter {self.numel}")
        if _in_c(flat, partition):
            _C.frag_scatter(self.layout, self.numel, self.offset, self.part, self.world, self.rank,
                            flat.data_ptr(), partition.data_ptr(), float(factor))
            return
        run = flat[self.param_at[self.rank]:self.param_at[self.rank] + self.length]
        self.real(partition).copy_(run * factor if factor != 1.0 else run)

    # --- local forms -----------------------------------------------------------------------------

    def real(self, partition: torch.Tensor) -> torch.Tensor:
        """This rank's real elements inside a partition-shaped tensor (a view)."""
        at = self.part_at[self.rank]
        return partition[at:at + self.length]

    def local(self, partition: torch.Tensor) -> torch.Tensor:
        """This rank's local form inside a partition-shaped tensor (a view; stage 3: the padded shard)."""
        at = self.part_at[self.rank]
        return partition[at:at + self.local_length]

    def read_local(self, partition: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
        """A copy of this rank's local form, divided by ``divisor``."""
        view = self.local(partition)
        if _in_c(view):
            out = torch.empty(self.local_length, dtype=torch.float32)
            _C.frag_copy(view.data_ptr(), out.data_ptr(), view.numel(), _DIVIDE, float(divisor))
            return out
        return view / divisor if divisor != 1.0 else view.clone()

    def write_local(self, value: torch.Tensor, partition: torch.Tensor, factor: float = 1.0) -> None:
        """This rank's local form of ``partition`` = value (1-D, ``local_length``) times ``factor``."""
        view = self.local(partition)
        if value.numel() != view.numel():
            raise ValueError(f"this rank's fragment has {view.numel()} elements, the value {value.numel()}")
        if _in_c(view, value):
            _C.frag_copy(value.data_ptr(), view.data_ptr(), view.numel(), _MULTIPLY, float(factor))
            return
        view.copy_(value * factor if factor != 1.0 else value)

