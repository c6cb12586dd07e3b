"""One optimizer param group, flattened: the tensors ZeRO stages 0-2 keep for it on this rank.

[Note: flat group tensors]
- ``flat``: every trainable parameter of the group laid end to end in the model's dtype, padded to the
  planner's layout (csrc/planner.c); each parameter's ``.data`` is a view of it, so the model computes
  on it unchanged and one all-gather refreshes all of it after a step.
- ``master``: this rank's partition ``[lo, hi)`` of ``flat`` in the master dtype (fp32; bf16 with
  ``bf16.bf16_master_weights_and_grads``, optim/bf16_master.py), the tensor the optimizer updates.
  When the model's dtype is the master dtype the master *is* ``flat[lo:hi]`` (a view, no copy): the
  update lands in the parameters directly, and no second copy of the partition is held.
- ``grad``: this rank's gradient partition in the master dtype (``master.grad``), where reduced
  gradients accumulate.
  Stage 2 frees it after an applied step and makes it again, zeroed, when the next backward's first
  bucket lands (``free_grad`` / ``ensure_grad``): between steps it would only hold zeros.
- With optimizer offload (``host``, offload/plan.py) ``master`` and ``grad`` are host-memory tensors of their
  own — never views of ``flat`` — and the step writes the new values back into ``flat``.
- ``lp_grad`` (stages 0 and 1 only): a flat buffer in the model's dtype whose views are the
  parameters' ``.grad``, so autograd accumulates straight into it and the reduction at the
  accumulation boundary works on one contiguous tensor.
- ``acc_grad`` (stage 1, bf16 with ``data_types.grad_accum_dtype`` fp32, DeepSpeed's BF16 optimizer):
  a full fp32 buffer into which each backward's ``lp_grad`` is folded (``fold_lp_grads``), so micro
  steps accumulate in fp32; the boundary reduces it, and ``grad`` is its partition.
Stage 0 replicates: every rank "owns" the whole buffer (``lo, hi = 0, padded``).
"""
from typing import List, Optional

import torch

from .._native import cuda, planner
from ..offload.plan import HostMemory


class FlatGroup:
    def __init__(self, params: List[torch.nn.Parameter], world: int, rank: int, partitioned: bool,
                 keep_lp_grads: bool, device: torch.device, host: Optional[HostMemory] = None,
                 accum_fp32: bool = False, master_dtype: torch.dtype = torch.float32, process_group=None,
                 domain=None):
        self.params = params
        # the group it is partitioned and reduced over: the data-parallel one, or for mixture-of-experts
        # parameters their expert-data-parallel group (``domain``, optim/experts.py; None: dense)
        self.pg, self.domain = process_group, domain
        self.numels = [p.numel() for p in params]
        self.world, self.rank, self.partitioned = world, rank, partitioned
        layout_world = world if partitioned else 1
        self.padded, self.offsets = planner.flat_layout(self.numels, layout_world)
        self.part = self.padded // layout_world
        self.lo = rank * self.part if partitioned else 0
        self.hi = self.lo + self.part
        self.dtype = params[0].dtype
        # the fragments of each parameter inside this rank's partition: (param, param_offset, part_offset, length)
        self.fragments = planner.flat_fragments(self.numels, layout_world, rank if partitioned else 0)

        self.flat = torch.zeros(self.padded, dtype=self.dtype, device=device)
        for p, off, n in zip(params, self.offsets, self.numels):
            self.flat[off:off + n].copy_(p.data.reshape(-1))
            p.data = self.flat[off:off + n].view(p.shape)
        self.master_dtype = master_dtype
        fp32 = self.dtype == master_dtype  # (the name says the common case: the model is in the master dtype)
        self.offloaded = host is not None
        if self.offloaded:
            self.master = host.copy_of(self.flat[self.lo:self.hi], master_dtype)
        else:
            own = self.flat[self.lo:self.hi]
            self.master = own if fp32 else own.to(master_dtype)
        self.lp_grad = self.acc_grad = None
        if keep_lp_grads:
            self.lp_grad = torch.zeros(self.padded, dtype=self.dtype, device=device)
            self.attach_lp_grads()
            if accum_fp32 and not fp32:
                self.acc_grad = torch.zeros(self.padded, dtype=torch.float32, device=device)
        # fp32 models reduce straight into their own gradient buffer's partition: no second copy
        if self.offloaded:
            self.grad = host.zeros(self.part, master_dtype)
        elif keep_lp_grads and fp32:
            self.grad = self.lp_grad[self.lo:self.hi]
        elif self.acc_grad is not None:
            self.grad = self.acc_grad[self.lo:self.hi]
        else:
            self.grad = torch.zeros(self.part, dtype=master_dtype, device=device)
        self.master.grad = self.grad
        self.host = host

    def free_grad(self) -> None:
        """Drops the gradient partition (stage 2, after the step); ``ensure_grad`` makes it again."""
        self.grad = None
        self.master.grad = None

    def ensure_grad(self) -> torch.Tensor:
        """The gradient partition, made (zeroed) if ``free_grad`` dropped it."""
        if self.grad is None:
            self.grad = torch.zeros(self.part, dtype=self.master_dtype, device=self.flat.device)
            self.master.grad = self.grad
        return self.grad

    def attach_lp_grads(self, keep_assigned: bool = False) -> None:
        """Points every parameter's ``.grad`` at its slice of ``lp_grad`` (autograd adds in place);
        ``keep_assigned``: only those whose ``.grad`` is None."""
        for p, off, n in zip(self.params, self.offsets, self.numels):
            if not (keep_assigned and p.grad is not None):
                p.grad = self.lp_grad[off:off + n].view(p.shape)

    def collect_lp_grads(self) -> None:
        """Brings gradients that left ``lp_grad`` back into it: a user's ``model.zero_grad()`` sets
        ``.grad`` to None, after which autograd allocates fresh tensors."""
        for p, off, n in zip(self.params, self.offsets, self.numels):
            slot = self.lp_grad[off:off + n]
            if p.grad is None:
                slot.zero_()
            elif p.grad.data_ptr() != slot.data_ptr():
                slot.copy_(p.grad.reshape(-1))
        self.attach_lp_grads()

    @property
    def boundary_grad(self) -> torch.Tensor:
        """The full flat gradient the boundary reduces: ``acc_grad`` when accumulating in fp32."""
        return self.acc_grad if self.acc_grad is not None else self.lp_grad

    def fold_lp_grads(self) -> None:
        """acc_grad += this backward's lp_grad (rounded to the model's dtype once), lp_grad zeroed."""
        self.collect_lp_grads()
        self.acc_grad.add_(self.lp_grad)
        self.lp_grad.zero_()

    def piece_of(self, i: int):
        """This rank's fragment of parameter i (a planner Piece), or None when it owns none of it."""
        if not hasattr(self, "_piece_of"):
            self._piece_of = {p.param: p for p in self.fragments}
        return self._piece_of.get(i)

    def copy_master_to_params(self) -> None:
        """Writes the updated master partition into the model's dtype (a no-op when they are one tensor)."""
        own = self.flat[self.lo:self.hi]
        if self.master.data_ptr() != own.data_ptr() and not cuda.cast_into(own, self.master):
            own.copy_(self.master)  # CPU, or no CUDA library: torch's copy (on CUDA: kernels/cast.cu)

    def grad_sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient partition (padding is zero), as an fp64 scalar.
        One norm kernel accumulating in fp32 (bf16 gradients too), squared in fp64: no partition-sized
        temporary."""
        return torch.linalg.vector_norm(self.grad, dtype=torch.float32).double() ** 2

    def tensors(self):
        """(kind, tensor) of every tensor this group holds, for memory accounting."""
        out = [("params", self.flat)]
        if self.lp_grad is not None:
            out.append(("grads", self.lp_grad))
        if self.acc_grad is not None:
            out.append(("fp32_grads", self.acc_grad))
        out.append(("fp32_master", self.master))  # listed after what it may alias (fp32 models): no bytes
        return out + ([("fp32_grads", self.grad)] if self.grad is not None else [])
