"""``deepspeed.runtime.activation_checkpointing.checkpointing`` (``deepspeed.checkpointing``): zero_ext's
activation checkpointing, zero_ext.activation_checkpointing."""
from zero_ext.activation_checkpointing import (checkpoint, configure, is_configured,  # noqa: F401
                                               non_reentrant_checkpoint, partition_activations_in_checkpoint, reset,
                                               set_num_layers)
from zero_ext.activation_checkpointing import deepspeed_globals as _globals  # noqa: E402


def __getattr__(name):
    """DeepSpeed's module globals (PARTITION_ACTIVATIONS, CPU_CHECKPOINT, num_layers, mpu, ...), read-only."""
    try:
        return _globals(name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
