"""``deepspeed.runtime``: zero_ext.runtime's import paths."""
from . import (activation_checkpointing, config, config_utils, constants, engine, fp16, lr_schedules,  # noqa: F401
               precision_config, swap_tensor, zero)
