"""``deepspeed.moe.utils``: the expert-parameter test and optimizer-group splitter (zero_ext/moe/params.py)."""
from ..moe.params import (DEFAULT_MAX_GROUP_SIZE, configure_moe_param_groups, is_moe_param,  # noqa: F401
                          is_moe_param_group, split_params_into_different_moe_groups_for_optimizer)

__all__ = ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param", "is_moe_param_group",
           "configure_moe_param_groups"]
