"""``deepspeed.checkpoint.utils``: the checkpoint files' names (DeepSpeed's layout, which zero_ext writes:
see zero_ext/checkpoint/engine_state.py) and clone_tensors_for_torch_save."""
import os

from zero_ext.checkpoint.files import clone_tensors_for_torch_save  # noqa: F401


def get_model_ckpt_name_for_rank(base_folder, mp_rank_str):
    """The model-states file of model-parallel rank ``mp_rank_str`` ("00": zero_ext has one)."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder, dp_rank, mp_rank):
    """Data-parallel rank ``dp_rank``'s optimizer-states file (zero_ext names bf16 runs' files with a bf16_
    prefix, as DeepSpeed's bf16 optimizer does)."""
    return os.path.join(base_folder, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")
