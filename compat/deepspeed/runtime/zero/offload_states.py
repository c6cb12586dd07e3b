"""``deepspeed.runtime.zero.offload_states``."""
from zero_ext.runtime.zero.offload_states import get_state_devices  # noqa: F401
