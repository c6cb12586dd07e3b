"""``deepspeed.runtime.zero.offload_states`` names."""
from ...offload.states import get_state_devices  # noqa: F401
