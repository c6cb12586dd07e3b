"""``deepspeed.runtime.zero.stage_1_and_2``: the ZeRO-2 memory estimators."""
from zero_ext.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,  # noqa: F401
                                                 estimate_zero2_model_states_mem_needs_all_cold,
                                                 estimate_zero2_model_states_mem_needs_all_live, model_to_params)
