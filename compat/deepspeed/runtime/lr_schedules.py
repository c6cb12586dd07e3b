"""``deepspeed.runtime.lr_schedules``."""
from zero_ext.runtime.lr_schedules import *  # noqa: F401,F403
from zero_ext.runtime.lr_schedules import VALID_LR_SCHEDULES  # noqa: F401
