"""``deepspeed.utils.z3_leaf_module``."""
from zero_ext.utils.z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,  # noqa: F401
                                           set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                                           unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)
