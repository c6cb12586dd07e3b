"""``deepspeed.runtime.activation_checkpointing.offload_activations``: host offload of the hidden states that
checkpointed layers keep (zero_ext.activation_checkpointing.offload_hidden_states)."""
from zero_ext.activation_checkpointing.offload_hidden_states import (  # noqa: F401
    CheckpointActivationOffloadStats, CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager, patch_gradient_checkpointing_layer_marker)
