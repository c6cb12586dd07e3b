"""``deepspeed.ops.adam``."""
from zero_ext.ops.adam import DeepSpeedCPUAdam  # noqa: F401
