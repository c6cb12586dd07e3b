"""``deepspeed.runtime.zero.offload_config`` names."""
from ...offload.states import OffloadDeviceEnum, OffloadStateTypeEnum  # noqa: F401
