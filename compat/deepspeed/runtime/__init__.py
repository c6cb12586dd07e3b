"""``deepspeed.runtime``: zero_ext.runtime's import paths."""
from . import (activation_checkpointing, base_optimizer, config, config_utils, constants, engine,  # noqa: F401
               fp16, lr_schedules, precision_config, swap_tensor, utils, zero)
