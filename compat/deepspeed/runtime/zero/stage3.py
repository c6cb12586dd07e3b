"""``deepspeed.runtime.zero.stage3``: the ZeRO-3 memory estimators, ``unwrap_model_for_generation``, and
DeepSpeedZeroOptimizer_Stage3 for isinstance."""
from zero_ext.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,  # noqa: F401
                                          estimate_zero3_model_states_mem_needs_all_cold,
                                          estimate_zero3_model_states_mem_needs_all_live, model_to_params,
                                          unwrap_model_for_generation)
from .stage_1_and_2 import _OfStages  # noqa: E402


class DeepSpeedZeroOptimizer_Stage3(metaclass=_OfStages):
    """DeepSpeed's ZeRO-3 optimizer class, for isinstance checks: zero_ext's ZeroOptimizer at stage 3."""

    stages = (3,)

    def __init__(self, *args, **kwargs):
        raise TypeError("DeepSpeedZeroOptimizer_Stage3 is built by deepspeed.initialize (zero_ext's ZeroOptimizer); "
                        "it is here for isinstance checks only")
