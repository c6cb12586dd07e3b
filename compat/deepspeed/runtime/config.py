"""``deepspeed.runtime.config``."""
from zero_ext.runtime.config import DeepSpeedConfig, DeepSpeedConfigError  # noqa: F401
