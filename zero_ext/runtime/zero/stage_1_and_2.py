"""``deepspeed.runtime.zero.stage_1_and_2`` names: the ZeRO-2 memory estimators (code: utils/estimate.py)."""
from ...utils.estimate import (estimate_zero2_model_states_mem_needs,  # noqa: F401
                               estimate_zero2_model_states_mem_needs_all_cold,
                               estimate_zero2_model_states_mem_needs_all_live, model_to_params)
