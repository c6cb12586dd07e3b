"""``deepspeed.ops.adagrad``."""
from zero_ext.ops.adagrad import DeepSpeedCPUAdagrad  # noqa: F401
