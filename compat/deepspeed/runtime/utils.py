"""``deepspeed.runtime.utils``."""
from zero_ext.runtime.utils import see_memory_usage  # noqa: F401
