"""``deepspeed.checkpointing`` (DeepSpeed's activation checkpointing API), ``zero_ext.checkpointing``.

    import zero_ext as deepspeed
    deepspeed.checkpointing.configure(mpu, partition_activations=True, checkpoint_in_cpu=True)
    h = deepspeed.checkpointing.checkpoint(block, h)

Files:
- settings.py: ``configure`` / ``is_configured``, the settings (the config's ``activation_checkpointing``
  section and the arguments), and the model-parallel group partitions are taken over.
- saved.py: what a checkpointed call keeps of its inputs until backward (partition, host copy,
  contiguous buffers) and makes of it again (all-gather, copy back); the bytes held now.
- checkpoint.py: ``checkpoint`` over torch's reentrant checkpoint, ``non_reentrant_checkpoint``, ``reset``,
  the boundary synchronisation and the profile log.
- offload_hidden_states.py: ``CheckpointHiddenStatesOffload``, host offload of the hidden states torch's
  non-reentrant checkpoint keeps (DeepSpeed's offload_activations module).
"""
from .checkpoint import checkpoint, non_reentrant_checkpoint, reset
from .offload_hidden_states import CheckpointHiddenStatesOffload, get_checkpoint_hidden_states_offloading_ctx_manager
from .saved import held, held_bytes
from .settings import (CheckpointingConfigError, configure, configure_from_engine, current, deepspeed_globals,
                       is_configured, reset_settings)


def __getattr__(name):
    """DeepSpeed's module globals (PARTITION_ACTIVATIONS, CPU_CHECKPOINT, num_layers, mpu, ...), read-only:
    the settings of the last configure()."""
    try:
        return deepspeed_globals(name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's setter of partition_activations alone (the other settings kept)."""
    s = current()
    configure(s.mpu, partition_activations=partition_activation,
              contiguous_checkpointing=s.contiguous_memory_optimization, num_checkpoints=s.number_checkpoints,
              checkpoint_in_cpu=s.cpu_checkpointing, synchronize=s.synchronize_checkpoint_boundary, profile=s.profile)


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's setter of number_checkpoints alone."""
    s = current()
    configure(s.mpu, partition_activations=s.partition_activations,
              contiguous_checkpointing=s.contiguous_memory_optimization, num_checkpoints=nlayers,
              checkpoint_in_cpu=s.cpu_checkpointing, synchronize=s.synchronize_checkpoint_boundary, profile=s.profile)


__all__ = ["configure", "is_configured", "checkpoint", "non_reentrant_checkpoint", "reset",
           "partition_activations_in_checkpoint", "set_num_layers", "held", "held_bytes", "current"]
