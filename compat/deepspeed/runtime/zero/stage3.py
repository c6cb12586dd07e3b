"""``deepspeed.runtime.zero.stage3``: the ZeRO-3 memory estimators, ``unwrap_model_for_generation``, and
DeepSpeedZeroOptimizer_Stage3 for isinstance."""
from zero_ext.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,  # noqa: F401
                                          estimate_zero3_model_states_mem_needs_all_cold,
                                          estimate_zero3_model_states_mem_needs_all_live, model_to_params,
                                          unwrap_model_for_generation)
from .._isinstance_only import isinstance_only  # noqa: E402
from .stage_1_and_2 import at_stages  # noqa: E402

DeepSpeedZeroOptimizer_Stage3 = isinstance_only(
    "DeepSpeedZeroOptimizer_Stage3", __name__, "DeepSpeed's ZeRO-3 optimizer class, for isinstance checks: "
    "zero_ext's ZeroOptimizer at stage 3.", at_stages(3),
    "DeepSpeedZeroOptimizer_Stage3 is built by deepspeed.initialize (zero_ext's ZeroOptimizer); it is here for "
    "isinstance checks only")
