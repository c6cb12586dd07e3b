"""``deepspeed.checkpoint.utils``."""
from zero_ext.checkpoint_io import clone_tensors_for_torch_save  # noqa: F401
