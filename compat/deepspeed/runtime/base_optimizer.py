"""``deepspeed.runtime.base_optimizer``: DeepSpeed's optimizer base classes, for isinstance checks."""
from zero_ext.optim.zero_optimizer import ZeroOptimizer as _ZeroOptimizer

from ._isinstance_only import isinstance_only
from .bf16_optimizer import is_bf16_optimizer

DeepSpeedOptimizer = isinstance_only(
    "DeepSpeedOptimizer", __name__, "DeepSpeed's optimizer base class, for isinstance checks: zero_ext's "
    "ZeroOptimizer at any stage.", lambda obj: isinstance(obj, _ZeroOptimizer),
    "DeepSpeedOptimizer is built by deepspeed.initialize (zero_ext's ZeroOptimizer); it is here for isinstance "
    "checks only")

ZeROOptimizer = isinstance_only(
    "ZeROOptimizer", __name__, "DeepSpeed's base of its ZeRO optimizers (and BF16_Optimizer), for isinstance "
    "checks: zero_ext's ZeroOptimizer at stages 1-3, or in the bf16 case DeepSpeed builds BF16_Optimizer for.",
    lambda obj: isinstance(obj, _ZeroOptimizer) and (obj.stage >= 1 or is_bf16_optimizer(obj)),
    "ZeROOptimizer is built by deepspeed.initialize (zero_ext's ZeroOptimizer); it is here for isinstance "
    "checks only")
