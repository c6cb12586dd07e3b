"""``deepspeed.runtime.zero.stage3``: the ZeRO-3 memory estimators and ``unwrap_model_for_generation``."""
from zero_ext.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,  # noqa: F401
                                          estimate_zero3_model_states_mem_needs_all_cold,
                                          estimate_zero3_model_states_mem_needs_all_live, model_to_params,
                                          unwrap_model_for_generation)
