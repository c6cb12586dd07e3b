"""``zero_ext.utils.zero_to_fp32``: the offline converter, under DeepSpeed's import path."""
from ..zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,  # noqa: F401
                            get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint, main)
