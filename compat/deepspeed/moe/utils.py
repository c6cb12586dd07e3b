"""``deepspeed.moe.utils``."""
from zero_ext.utils.moe import (configure_moe_param_groups, is_moe_param, is_moe_param_group,  # noqa: F401
                                split_params_into_different_moe_groups_for_optimizer)
