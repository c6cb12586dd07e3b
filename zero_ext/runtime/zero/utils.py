"""``deepspeed.runtime.zero.utils`` names."""
from ...config.errors import ZeRORuntimeException  # noqa: F401
from ...zero.utils import is_zero_param  # noqa: F401
