"""``deepspeed.runtime.zero.offload_config``."""
from zero_ext.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,  # noqa: F401
                                                  DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum,
                                                  OffloadStateTypeEnum)
