"""``deepspeed.utils``: zero_ext.utils (safe_get_* / safe_set_*, zero_to_fp32, leaf modules, logger)."""
from zero_ext.utils import *  # noqa: F401,F403
from zero_ext.utils import logger, set_z3_leaf_modules, unset_z3_leaf_modules, get_z3_leaf_modules  # noqa: F401
from zero_ext.utils import zero_to_fp32  # noqa: F401
from zero_ext.comm import is_initialized  # noqa: F401
