"""``deepspeed.runtime.zero.stage3`` names: the ZeRO-3 memory estimators (code: utils/estimate.py) and
``unwrap_model_for_generation`` (code: zero/generation.py).
"""
from ...utils.estimate import (estimate_zero3_model_states_mem_needs,  # noqa: F401
                               estimate_zero3_model_states_mem_needs_all_cold,
                               estimate_zero3_model_states_mem_needs_all_live, model_to_params)
from ...zero.generation import unwrap_model_for_generation  # noqa: F401
