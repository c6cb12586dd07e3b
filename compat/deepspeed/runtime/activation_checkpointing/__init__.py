"""``deepspeed.runtime.activation_checkpointing``: zero_ext.activation_checkpointing (``deepspeed.checkpointing``)."""
from . import checkpointing  # noqa: F401
