"""``deepspeed.runtime.fp16.unfused_optimizer``: FP16_UnfusedOptimizer, for isinstance checks.

DeepSpeed uses it at stage 0 in fp16 for optimizers other than its fused Adam (LAMB, client optimizers).
zero_ext has no second stage-0 path: every optimizer runs in the ZeroOptimizer that FP16_Optimizer
matches, so nothing is an instance of this class."""


from .._isinstance_only import isinstance_only

FP16_UnfusedOptimizer = isinstance_only(
    "FP16_UnfusedOptimizer", __name__, "DeepSpeed's unfused stage-0 fp16 optimizer: zero_ext never builds one "
    "(see the module's note).", lambda obj: False,
    "FP16_UnfusedOptimizer: zero_ext runs every stage-0 optimizer in its ZeroOptimizer "
    "(deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer matches it)")
