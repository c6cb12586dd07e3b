"""``deepspeed.utils.logging``."""
from zero_ext.utils.logging import logger  # noqa: F401
