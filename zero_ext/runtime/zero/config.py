"""``deepspeed.runtime.zero.config`` names, mapped onto zero_ext.config's models.

``DeepSpeedZeroConfig`` is the ``zero_optimization`` section (zero_ext.config.ZeroConfig): the same keys,
aliases and defaults as DeepSpeed's, validated (an unknown key is an error, not ignored). The offload
sections are ``offload_optimizer`` / ``offload_param`` (OffloadOptimizerConfig / OffloadParamConfig).
"""
from ...config import OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

DeepSpeedZeroConfig = ZeroConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
OffloadDeviceEnum = OffloadDevice  # the config's device enum (none / cpu / nvme)

ZERO_OPTIMIZATION = "zero_optimization"

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZERO_OPTIMIZATION"]
