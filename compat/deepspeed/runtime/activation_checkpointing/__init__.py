"""``deepspeed.runtime.activation_checkpointing``: zero_ext.activation_checkpointing (``deepspeed.checkpointing``)."""
from . import checkpointing, offload_activations  # noqa: F401
