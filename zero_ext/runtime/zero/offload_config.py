"""``deepspeed.runtime.zero.offload_config`` names."""
from ...offload_states import OffloadDeviceEnum, OffloadStateTypeEnum  # noqa: F401
