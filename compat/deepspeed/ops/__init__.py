"""``deepspeed.ops``: zero_ext.ops's CPU optimizers (C kernels), and which of DeepSpeed's ops exist
(``__compatible_ops__``, from op_builder)."""
from . import adagrad, adam, aio, lion, op_builder  # noqa: F401

__compatible_ops__ = {name: builder.is_compatible() for name, builder in op_builder.ALL_OPS.items()}
