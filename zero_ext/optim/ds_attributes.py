"""DeepSpeed's optimizer attributes that libraries, scripts and its unit tests read, as read-only views of
ZeroOptimizer's groups (a mixin of ZeroOptimizer): the loss-scale names of its FP16/BF16 optimizers, the
16-bit and fp32 groups of each stage under DeepSpeed's names. An attribute of another stage than the one
running raises AttributeError naming both."""
from typing import List, Optional

import torch

from .._native import planner
from .loss_scaler import LossScaleView


class DeepSpeedAttributes:
    #: whether the base optimizer is what DeepSpeed treats as fused (its FusedAdam: a config Adam/AdamW
    #: section without torch_adam, or a FusedAdam instance); at stage 0 over a 16-bit model DeepSpeed wraps
    #: such an optimizer in FP16_Optimizer and any other in FP16_UnfusedOptimizer. Set by build.py.
    fused_base: bool = False

    @property
    def _global_grad_norm(self) -> Optional[float]:
        """DeepSpeed's name of global_grad_norm (its tests and some training loops read it)."""
        return self.global_grad_norm

    @property
    def cur_scale(self) -> float:
        """The current loss scale (1 without fp16)."""
        return self.loss_scaler.cur_scale

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaler.dynamic

    @property
    def loss_scale_config(self) -> LossScaleView:
        """DeepSpeed's LossScaleConfig of this optimizer: the scaler's state under its names (read-only)."""
        fp16 = any(p.dtype == torch.float16 for g in self.flat_groups for p in g.params)
        return LossScaleView(self.loss_scaler, fp16)

    @property
    def low_precision_dtype(self) -> torch.dtype:
        """The dtype the model trains in (DeepSpeed's FP16 optimizers' attribute); fp32 for an fp32 model."""
        return next((g.dtype for g in self.flat_groups), torch.float32)

    def needs_scaler(self) -> bool:
        """Whether a loss must be scaled before backward (fp16 with a loss scale): DeepSpeed's question
        before a direct loss.backward() (optim/direct_backward.py)."""
        return self.dynamic_loss_scale or self.cur_scale != 1.0

    # DeepSpeed's optimizer attributes that libraries and scripts read: read-only views of our groups
    @property
    def fp16_groups(self) -> List[List[torch.nn.Parameter]]:
        """The model parameters of each flat group (DeepSpeed's ``fp16_groups`` / ``bit16_groups``: per
        param group at stages 1/2, per sub-group at stage 3), whatever the model's dtype."""
        return [list(g.params) for g in self.flat_groups]

    bit16_groups = fp16_groups

    @property
    def single_partition_of_fp32_groups(self) -> List[torch.Tensor]:
        """Stages 1/2: this rank's fp32 master partition of each group (the tensors the optimizer steps)."""
        return self._masters((1, 2), "single_partition_of_fp32_groups")

    @property
    def fp32_partitioned_groups_flat(self) -> List[torch.Tensor]:
        """Stage 3: this rank's fp32 master of each sub-group (its parameters' pieces back to back)."""
        return self._masters((3,), "fp32_partitioned_groups_flat")

    @property
    def fp32_groups_flat(self) -> List[torch.Tensor]:
        """Stage 0: each group's fp32 master, whole (DeepSpeed's FP16_Optimizer attribute)."""
        return self._masters((0,), "fp32_groups_flat")

    @property
    def fp32_groups(self) -> List[List[torch.Tensor]]:
        """Stage 0: each group's fp32 master per parameter, shaped like it (DeepSpeed's FP16_UnfusedOptimizer
        attribute): views of ``fp32_groups_flat``."""
        return [[m[off:off + n].view(p.shape) for p, off, n in zip(g.params, g.offsets, g.numels)]
                for m, g in zip(self._masters((0,), "fp32_groups"), self.flat_groups)]

    @property
    def parallel_partitioned_bit16_groups(self) -> List[List[torch.Tensor]]:
        """Stages 1/2: each group's 16-bit flat buffer cut into the ranks' partitions (views, rank by rank)."""
        if self.stage not in (1, 2):
            raise AttributeError(f"ZeroOptimizer.parallel_partitioned_bit16_groups is DeepSpeed's attribute at ZeRO "
                                 f"stage 1 / 2, this optimizer runs stage {self.stage}")
        return [[g.flat[r * g.part:(r + 1) * g.part] for r in range(g.world)] for g in self.flat_groups]

    parallel_partitioned_fp16_groups = parallel_partitioned_bit16_groups

    @property
    def bit16_groups_flat(self) -> List[torch.Tensor]:
        """Stages 1/2: each group's flat buffer in the model's dtype (the parameters are views of it; on the
        compute device, outside autograd)."""
        if self.stage not in (1, 2):
            raise AttributeError(f"ZeroOptimizer.bit16_groups_flat is DeepSpeed's attribute at ZeRO stage 1 / 2, "
                                 f"this optimizer runs stage {self.stage}")
        return [g.flat for g in self.flat_groups]
    nccl_start_alignment_factor = planner.NCCL_START_ALIGNMENT_FACTOR  # partitions start at multiples of it

    def _masters(self, stages, name: str) -> List[torch.Tensor]:
        if self.stage not in stages:
            raise AttributeError(f"ZeroOptimizer.{name} is DeepSpeed's attribute at ZeRO stage "
                                 f"{' / '.join(map(str, stages))}, this optimizer runs stage {self.stage}")
        if self.nvme is not None:
            raise RuntimeError(f"ZeroOptimizer.{name}: the fp32 masters live on NVMe; read them inside "
                               "`with engine.optimizer.materialized():` as flat_groups[i].master, or per parameter "
                               "with deepspeed.utils.safe_get_full_fp32_param")
        return [g.master for g in self.flat_groups]
