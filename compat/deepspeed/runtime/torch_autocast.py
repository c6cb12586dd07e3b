"""``deepspeed.runtime.torch_autocast``."""
from zero_ext.runtime.torch_autocast import (LOWER_PRECISION_SAFE_MODULES, PARAM_COMM_DTYPE_ATTR_NAME,  # noqa: F401
                                             autocast_if_enabled, get_all_comm_dtypes, get_autocast_dtype,
                                             get_comm_dtype, get_default_autocast_lower_precision_modules,
                                             has_comm_dtype, init_autocast_params, is_autocast_initialized,
                                             sort_dtypes)
