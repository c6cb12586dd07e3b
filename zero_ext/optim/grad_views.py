"""DeepSpeed's gradient attributes of its ZeRO optimizers, as views of ZeroOptimizer's fp32 gradient
partitions (a mixin of ZeroOptimizer): what DeepSpeed's unit tests and libraries built on its internals read.

- ``averaged_gradients``: {group index: [this rank's averaged fp32 gradient of each parameter piece in
  the group's partition]}. Stages 0-2: one tensor per parameter fragment inside this rank's partition of
  the param group, in order (DeepSpeed's ``params_in_partition``); stage 3: one per parameter of each
  sub-group, its piece (``ds_tensor``'s size, padding included).
- ``_get_norm_groups()``: each flat group's gradient norm over every rank (what the global norm combines).
- ``get_fp32_grad_partitions()`` (stage 3, as in DeepSpeed): {sub-group index: {parameter index in
  the sub-group: its fp32 gradient piece}}.

Both are views: writing into them changes what the step applies. Reading them is the state routines'
gradient read (engine.gradients): collective, only between the backward that produced the gradients
and the step that consumes them, and at stages 0/1 only at the accumulation boundary, where it runs the
reduction that step() would have run (the values are then averaged over the ranks, as DeepSpeed's are).
"""
from typing import Callable, Dict, List, Optional

import torch

from .. import comm
from ..ops.functional import grad_sqnorm


class GradientViews:
    #: the engine's gradient-read check (ZeroEngine.gradients), set by the engine; without an engine the
    #: gradients are averaged on demand
    gradient_reader: Optional[Callable[[str], object]] = None

    def _read_gradients(self, what: str) -> None:
        if self.gradient_reader is not None:
            self.gradient_reader(what)
        else:
            self.ensure_reduced()

    @property
    def averaged_gradients(self) -> Dict[int, List[torch.Tensor]]:
        """DeepSpeed's ``averaged_gradients`` (see the module docstring). Collective."""
        self._read_gradients("ZeroOptimizer.averaged_gradients")
        out = {}
        for k, g in enumerate(self.flat_groups):
            if hasattr(g, "fragments"):  # stages 0-2: the parameters' runs inside this rank's partition
                out[k] = [g.grad[f.part_offset:f.part_offset + f.length] for f in g.fragments]
            else:  # stage 3: each parameter's piece, back to back
                out[k] = [g.grad[off:off + s] for off, s in zip(g.offsets, g.shards)]
        return out

    def _get_norm_groups(self) -> List[torch.Tensor]:
        """DeepSpeed's: the L2 norm over every rank of each flat group's averaged gradient (stage 3: each
        sub-group's), still loss-scaled as before the step; combined they are the global norm the step
        clips with, and a gradient changed by safe_set_* shows in them. Collective (data-parallel)."""
        if self.model_parallel is not None:
            raise NotImplementedError("ZeroOptimizer._get_norm_groups: not with a model-parallel mpu (a "
                                      "parameter's norm would count once per model-parallel rank); use "
                                      "engine.get_global_grad_norm() after the step")
        self._read_gradients("ZeroOptimizer._get_norm_groups")
        device = self._device()
        sq = torch.stack([torch.tensor(grad_sqnorm(g.grad), dtype=torch.float64) if g.grad.is_cpu
                          else g.grad_sq_norm() for g in self.flat_groups]).to(device)
        if self.stage >= 1 and self.world > 1:
            comm.all_reduce(sq, group=self.pg)
        return list(sq.sqrt().float().unbind())

    def get_fp32_grad_partitions(self) -> Dict[int, Dict[int, torch.Tensor]]:
        """Stage 3: {sub-group: {parameter index: its fp32 gradient piece}} (DeepSpeed's). Collective."""
        if self.stage != 3:
            raise AttributeError(f"ZeroOptimizer.get_fp32_grad_partitions is DeepSpeed's method at ZeRO stage 3, this "
                                 f"optimizer runs stage {self.stage}: use averaged_gradients")
        self._read_gradients("ZeroOptimizer.get_fp32_grad_partitions")
        return {k: {i: g.grad[off:off + s] for i, (off, s) in enumerate(zip(g.offsets, g.shards))}
                for k, g in enumerate(self.flat_groups)}


__all__ = ["GradientViews"]
