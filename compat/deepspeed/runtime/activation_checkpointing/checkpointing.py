"""``deepspeed.runtime.activation_checkpointing.checkpointing`` (``deepspeed.checkpointing``): zero_ext's
activation checkpointing, zero_ext.activation_checkpointing."""
from zero_ext.activation_checkpointing import (checkpoint, configure, is_configured,  # noqa: F401
                                               non_reentrant_checkpoint, partition_activations_in_checkpoint, reset,
                                               set_num_layers)
