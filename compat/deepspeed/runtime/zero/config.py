"""``deepspeed.runtime.zero.config``."""
from zero_ext.runtime.zero.config import (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig,  # noqa: F401
                                          DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum, ZERO_OPTIMIZATION)
