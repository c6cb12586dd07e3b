"""``deepspeed.utils.init_on_device``."""
from zero_ext.utils.init_on_device import OnDevice  # noqa: F401
