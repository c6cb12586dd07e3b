"""``deepspeed.runtime.zero.linear``: zero3_linear_wrap and LinearFunctionForZeroStage3 (zero/linear.py)."""
from ...zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap  # noqa: F401
