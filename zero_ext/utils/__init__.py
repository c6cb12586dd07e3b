"""zero_ext.utils: DeepSpeed's ``deepspeed.utils`` names: the state routines (safe_get_* / safe_set_*),
``zero_to_fp32``, ZeRO-3 leaf modules and ``logger`` (the ``zero_ext`` logger; transformers sets its level).

Files:
- safe_state.py: safe_get / safe_set, partitioned state read and changed one parameter at a time.
- zero_to_fp32.py: DeepSpeed's import path of checkpoint/zero_to_fp32.py.
"""
import logging

from .safe_state import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,  # noqa: F401
                         safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                         safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                         safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
                         safe_update_full_grad_vectorized)
from . import zero_to_fp32  # noqa: F401
from ..zero.leaf import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules  # noqa: F401

logger = logging.getLogger("zero_ext")
