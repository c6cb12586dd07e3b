"""``deepspeed.runtime.torch_autocast``: DeepSpeed's names for the torch_autocast support
(zero_ext/precision/autocast.py)."""
from ..precision.autocast import (LOWER_PRECISION_SAFE_MODULES, PARAM_COMM_DTYPE_ATTR_NAME,  # noqa: F401
                                  autocast_if_enabled, get_all_comm_dtypes, get_autocast_dtype, get_comm_dtype,
                                  get_default_autocast_lower_precision_modules, has_comm_dtype, init_autocast_params,
                                  is_autocast_initialized, sort_dtypes)
