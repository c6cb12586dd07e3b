"""``deepspeed.runtime``: zero_ext.runtime's import paths."""
from . import engine, lr_schedules, zero  # noqa: F401
