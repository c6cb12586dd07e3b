"""``deepspeed.runtime.fp16``: DeepSpeed's stage-0 mixed-precision optimizer classes, for isinstance checks."""
from . import fused_optimizer, unfused_optimizer  # noqa: F401
