"""``deepspeed.ops.adam``."""
from zero_ext.ops.adam import DeepSpeedCPUAdam  # noqa: F401
from zero_ext.ops.fused_adam import FusedAdam  # noqa: F401
