"""``deepspeed.runtime.zero.linear``."""
from zero_ext.runtime.zero.linear import (LinearFunctionForZeroStage3, LinearModuleForZeroStage3,  # noqa: F401
                                          autocast_custom_bwd, autocast_custom_fwd, noop_decorator,
                                          zero3_linear_wrap)
