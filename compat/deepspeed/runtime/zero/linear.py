"""``deepspeed.runtime.zero.linear``."""
from zero_ext.runtime.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap  # noqa: F401
