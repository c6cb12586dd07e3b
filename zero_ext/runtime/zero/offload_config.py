"""``deepspeed.runtime.zero.offload_config`` names (the offload sections' config classes are defined here in
DeepSpeed; ``config.py`` re-exports them there and here alike)."""
from ...offload.states import OffloadDeviceEnum, OffloadStateTypeEnum  # noqa: F401
from .config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig  # noqa: F401
