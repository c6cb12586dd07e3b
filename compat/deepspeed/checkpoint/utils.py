"""``deepspeed.checkpoint.utils``."""
from zero_ext.checkpoint.files import clone_tensors_for_torch_save  # noqa: F401
