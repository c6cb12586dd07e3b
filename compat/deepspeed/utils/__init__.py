"""``deepspeed.utils``: zero_ext.utils (safe_get_* / safe_set_*, zero_to_fp32, leaf modules, logger).

Submodules at DeepSpeed's paths, importable with ``from deepspeed.utils.X import ...``: logging,
zero_to_fp32, z3_leaf_module. ``deepspeed.utils.logging`` is DeepSpeed's logging module (with ``logger``),
never the standard library's.
"""
from zero_ext.utils import *  # noqa: F401,F403  (zero_ext.utils.__all__)
from zero_ext.utils import logger, set_z3_leaf_modules, unset_z3_leaf_modules, get_z3_leaf_modules  # noqa: F401
from zero_ext.comm import is_initialized  # noqa: F401
# Each import below loads this package's submodule (binding it here, over the star import's names), then
# z3_leaf_module is rebound to the function, as in DeepSpeed; the submodule stays importable by path.
from .logging import logger, get_log_level_from_string, set_log_level_from_string  # noqa: F401,F811,E402
from .zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401,E402
from .z3_leaf_module import z3_leaf_module  # noqa: F401,F811,E402
