"""``deepspeed.runtime.engine``."""
from zero_ext.runtime.engine import DeepSpeedEngine  # noqa: F401
