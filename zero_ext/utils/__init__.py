"""zero_ext.utils: DeepSpeed's ``deepspeed.utils`` names: the state routines (safe_get_* / safe_set_*),
``zero_to_fp32``, ZeRO-3 leaf modules and ``logger`` (the ``zero_ext`` logger; transformers sets its level).

Files:
- safe_state.py: safe_get / safe_set, partitioned state read and changed one parameter at a time.
- zero_to_fp32.py: DeepSpeed's import path of checkpoint/zero_to_fp32.py.
- logging.py: ``deepspeed.utils.logging`` (``logger``; Lightning sets its level through that path).
- z3_leaf_module.py: ``deepspeed.utils.z3_leaf_module`` (leaf modules by class, name or name suffix).
- moe.py: ``deepspeed.moe.utils``' names (moe/params.py: the expert-parameter test, the group splitter).
- runtime_utils.py: ``deepspeed.runtime.utils``' helpers on plain parameter lists (clip_grad_norm_,
  get_weight_norm, CheckOverflow, call_to_str, count_used_parameters_in_backward).
- init_on_device.py: ``deepspeed.OnDevice`` (a module's tensors made on a device, in a floating dtype).
- estimate.py: the ZeRO-2 / ZeRO-3 memory estimators (DeepSpeed's names and table; zero_ext's bytes).
"""
from .safe_state import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,  # noqa: F401
                         safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                         safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                         safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
                         safe_update_full_grad_vectorized)
from . import logging, z3_leaf_module, zero_to_fp32  # noqa: F401  (submodules at DeepSpeed's paths)
from .logging import logger
# As in DeepSpeed, the name z3_leaf_module is then the function; the submodule stays importable by path.
from .z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,  # noqa: F401
                             set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules,
                             z3_leaf_module, z3_leaf_parameter)
from .moe import split_params_into_different_moe_groups_for_optimizer  # noqa: F401
from .init_on_device import OnDevice  # noqa: F401

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized", "logging", "logger", "zero_to_fp32", "z3_leaf_module",
           "get_z3_leaf_modules", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "set_z3_leaf_module", "unset_z3_leaf_modules", "z3_leaf_parameter",
           "split_params_into_different_moe_groups_for_optimizer", "OnDevice"]
