"""``deepspeed.runtime.zero.utils`` names."""
from ...zero.utils import is_zero_param  # noqa: F401
