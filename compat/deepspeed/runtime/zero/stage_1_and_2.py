"""``deepspeed.runtime.zero.stage_1_and_2``: the ZeRO-2 memory estimators, and DeepSpeedZeroOptimizer for isinstance."""
from zero_ext.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,  # noqa: F401
                                                 estimate_zero2_model_states_mem_needs_all_cold,
                                                 estimate_zero2_model_states_mem_needs_all_live, model_to_params)
from zero_ext.optim.zero_optimizer import ZeroOptimizer as _ZeroOptimizer  # noqa: E402


class _OfStages(type):
    """isinstance(opt, DeepSpeedZeroOptimizer) is true for zero_ext's optimizer at the class's stages
    (zero_ext has one optimizer class for every stage; DeepSpeed has one per stage family)."""

    def __instancecheck__(cls, obj):
        from ..bf16_optimizer import is_bf16_optimizer  # (DeepSpeed's other class for one stage 1 case)

        return isinstance(obj, _ZeroOptimizer) and obj.stage in cls.stages and not is_bf16_optimizer(obj)


class DeepSpeedZeroOptimizer(metaclass=_OfStages):
    """DeepSpeed's ZeRO-1/2 optimizer class, for isinstance checks: zero_ext's ZeroOptimizer at stage 1 or 2."""

    stages = (1, 2)

    def __init__(self, *args, **kwargs):
        raise TypeError("DeepSpeedZeroOptimizer is built by deepspeed.initialize (zero_ext's ZeroOptimizer); "
                        "it is here for isinstance checks only")
