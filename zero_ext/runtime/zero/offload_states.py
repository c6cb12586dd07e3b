"""``deepspeed.runtime.zero.offload_states`` names."""
from ...offload_states import get_state_devices  # noqa: F401
