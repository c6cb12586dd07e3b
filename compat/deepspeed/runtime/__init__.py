"""``deepspeed.runtime``: zero_ext.runtime's import paths."""
from . import config, engine, lr_schedules, zero  # noqa: F401
