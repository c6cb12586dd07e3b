"""``deepspeed.runtime.zero.utils``."""
from zero_ext.runtime.zero.utils import ZeRORuntimeException, is_zero_param  # noqa: F401
