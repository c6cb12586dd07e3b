"""``deepspeed.accelerator``: zero_ext's CUDA-or-CPU accelerator."""
from zero_ext.accelerator import get_accelerator, is_current_accelerator_supported  # noqa: F401
