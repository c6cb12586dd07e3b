"""``deepspeed.runtime.config``."""
from zero_ext.runtime.config import *  # noqa: F401,F403  (the optimizer name constants)
from zero_ext.runtime.config import DeepSpeedConfig, DeepSpeedConfigError, get_log_level  # noqa: F401
