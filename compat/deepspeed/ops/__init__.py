"""``deepspeed.ops``: zero_ext.ops's CPU optimizers (C kernels)."""
from . import adagrad, adam, lion  # noqa: F401
