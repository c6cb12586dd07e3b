"""``deepspeed.runtime.zero.stage3`` names: the ZeRO-3 memory estimators (code: utils/estimate.py).

Not here: DeepSpeed's ``unwrap_model_for_generation``. A GatheredParameters block over every parameter
does keep them whole, but zero_ext's module hooks still run inside it and still agree on the fetch order
across ranks, so ranks running different numbers of forwards (generation) would hang.
"""
from ...utils.estimate import (estimate_zero3_model_states_mem_needs,  # noqa: F401
                               estimate_zero3_model_states_mem_needs_all_cold,
                               estimate_zero3_model_states_mem_needs_all_live, model_to_params)
