"""DeepSpeed's ``deepspeed.runtime.zero.utils`` names that third-party code imports."""
from .param import is_zero_param
from .status import ZeroParamStatus

__all__ = ["is_zero_param", "ZeroParamStatus"]
