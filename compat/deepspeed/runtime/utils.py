"""``deepspeed.runtime.utils``."""
from zero_ext.runtime.utils import see_memory_usage  # noqa: F401
from zero_ext.utils.runtime_utils import (CheckOverflow, call_to_str, clip_grad_norm_,  # noqa: F401
                                          count_used_parameters_in_backward, get_global_norm, get_weight_norm)
