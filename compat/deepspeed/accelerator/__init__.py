"""``deepspeed.accelerator``: zero_ext's CUDA-or-CPU accelerator."""
from zero_ext.accelerator import get_accelerator  # noqa: F401
