"""``deepspeed.runtime.fp16.fused_optimizer``: FP16_Optimizer, for isinstance checks.

DeepSpeed wraps the optimizer in FP16_Optimizer when ZeRO is off (stage 0) and the model trains in fp16
or bf16; zero_ext runs that case in its one ZeroOptimizer, at stage 0."""
import torch

from zero_ext.optim.zero_optimizer import ZeroOptimizer as _ZeroOptimizer

from .._isinstance_only import isinstance_only



def _stage0_low_precision(obj) -> bool:
    return (isinstance(obj, _ZeroOptimizer) and obj.stage == 0
            and any(g.dtype != torch.float32 for g in obj.flat_groups if g is not None))


FP16_Optimizer = isinstance_only(
    "FP16_Optimizer", __name__, "DeepSpeed's stage-0 fp16/bf16 optimizer, for isinstance checks: zero_ext's "
    "ZeroOptimizer at stage 0 over a 16-bit model.", _stage0_low_precision,
    "FP16_Optimizer is built by deepspeed.initialize (zero_ext's ZeroOptimizer at stage 0); it is here for "
    "isinstance checks only")
