"""``deepspeed.runtime``: zero_ext.runtime's import paths."""
from . import (activation_checkpointing, config, config_utils, engine, lr_schedules, precision_config,  # noqa: F401
               swap_tensor, zero)
