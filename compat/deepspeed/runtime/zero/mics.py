"""``deepspeed.runtime.zero.mics``."""
from zero_ext.runtime.zero.mics import MiCS_Init  # noqa: F401
