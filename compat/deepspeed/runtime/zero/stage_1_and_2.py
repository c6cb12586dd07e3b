"""``deepspeed.runtime.zero.stage_1_and_2``: the ZeRO-2 memory estimators, and DeepSpeedZeroOptimizer for isinstance."""
from zero_ext.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,  # noqa: F401
                                                 estimate_zero2_model_states_mem_needs_all_cold,
                                                 estimate_zero2_model_states_mem_needs_all_live, model_to_params)
from zero_ext.optim.zero_optimizer import ZeroOptimizer as _ZeroOptimizer  # noqa: E402

from .._isinstance_only import isinstance_only  # noqa: E402



def at_stages(*stages):
    """zero_ext's optimizer at these stages (one class for every stage there; DeepSpeed has one per
    stage family), unless it is the stage 1 case DeepSpeed builds its BF16_Optimizer for."""
    from ..bf16_optimizer import is_bf16_optimizer

    return lambda obj: isinstance(obj, _ZeroOptimizer) and obj.stage in stages and not is_bf16_optimizer(obj)


DeepSpeedZeroOptimizer = isinstance_only(
    "DeepSpeedZeroOptimizer", __name__, "DeepSpeed's ZeRO-1/2 optimizer class, for isinstance checks: zero_ext's "
    "ZeroOptimizer at stage 1 or 2.", at_stages(1, 2),
    "DeepSpeedZeroOptimizer is built by deepspeed.initialize (zero_ext's ZeroOptimizer); it is here for "
    "isinstance checks only")
