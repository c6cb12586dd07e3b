"""``deepspeed.runtime.fp16.unfused_optimizer``: FP16_UnfusedOptimizer, for isinstance checks.

DeepSpeed uses it at stage 0 in fp16 or bf16 for optimizers other than its FusedAdam (a client torch
optimizer, LAMB, torch_adam); zero_ext runs that case in its ZeroOptimizer, which this class matches."""
from .._isinstance_only import isinstance_only
from .fused_optimizer import stage0_low_precision

FP16_UnfusedOptimizer = isinstance_only(
    "FP16_UnfusedOptimizer", __name__, "DeepSpeed's unfused stage-0 fp16/bf16 optimizer, for isinstance checks: "
    "zero_ext's ZeroOptimizer at stage 0 over a 16-bit model and a base other than FusedAdam.",
    lambda obj: stage0_low_precision(obj, False),
    "FP16_UnfusedOptimizer is built by deepspeed.initialize (zero_ext's ZeroOptimizer at stage 0); it is here "
    "for isinstance checks only")
