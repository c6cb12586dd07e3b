"""``deepspeed.utils.zero_to_fp32``: zero_ext's offline converter (``python -m deepspeed.utils.zero_to_fp32`` runs it)."""
import sys

from zero_ext.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,  # noqa: F401
                                         get_fp32_state_dict_from_zero_checkpoint, get_model_state_file,
                                         get_optim_files, load_state_dict_from_zero_checkpoint, main)

if __name__ == "__main__":
    sys.exit(main())
