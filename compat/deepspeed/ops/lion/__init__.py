"""``deepspeed.ops.lion``."""
from zero_ext.ops.lion import DeepSpeedCPULion  # noqa: F401
