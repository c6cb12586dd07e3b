"""``deepspeed.runtime.constants``."""
from zero_ext.runtime.constants import *  # noqa: F401,F403
