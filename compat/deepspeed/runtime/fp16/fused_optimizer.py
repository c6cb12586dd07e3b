"""``deepspeed.runtime.fp16.fused_optimizer``: FP16_Optimizer, for isinstance checks.

DeepSpeed wraps a fused optimizer (its FusedAdam: a config Adam/AdamW section, or a FusedAdam passed in)
in FP16_Optimizer when ZeRO is off (stage 0) and the model trains in fp16 or bf16, and any other optimizer
in FP16_UnfusedOptimizer; zero_ext runs both cases in its one ZeroOptimizer, at stage 0."""
import torch

from zero_ext.optim.zero_optimizer import ZeroOptimizer as _ZeroOptimizer

from .._isinstance_only import isinstance_only


def stage0_low_precision(obj, fused: bool) -> bool:
    """Whether ``obj`` is zero_ext's optimizer at stage 0 over a 16-bit model, on a fused (or unfused) base."""
    return (isinstance(obj, _ZeroOptimizer) and obj.stage == 0 and obj.fused_base == fused
            and any(g.dtype != torch.float32 for g in obj.flat_groups if g is not None))


FP16_Optimizer = isinstance_only(
    "FP16_Optimizer", __name__, "DeepSpeed's stage-0 fp16/bf16 optimizer over its FusedAdam, for isinstance "
    "checks: zero_ext's ZeroOptimizer at stage 0 over a 16-bit model and a fused base.",
    lambda obj: stage0_low_precision(obj, True),
    "FP16_Optimizer is built by deepspeed.initialize (zero_ext's ZeroOptimizer at stage 0); it is here for "
    "isinstance checks only")
