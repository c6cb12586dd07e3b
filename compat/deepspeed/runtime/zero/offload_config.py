"""``deepspeed.runtime.zero.offload_config``."""
from zero_ext.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum  # noqa: F401
