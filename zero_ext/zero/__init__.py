"""ZeRO-3's parameter layer: partitioned parameters and everything that gathers them.

    import zero_ext as deepspeed
    with deepspeed.zero.Init():                      # parameters partitioned as modules are built
        model = MyModel()
    with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        ...                                          # full values inside, rank 0's changes kept
    zm = deepspeed.zero.ZeroModel(model)             # gather/release around every forward/backward

Files, one noun each (docs/zero3.md has the design): status (enums), param (ZeroParam, the owner of
one parameter), collectives (free functions), fetch (fetch/release, fetch-order agreement), convert
(whole -> partitioned), external (external parameters), hooks (per-module hooks), model (ZeroModel),
gathered (GatheredParameters), init (zero.Init), tree (walking inputs/outputs), utils (DeepSpeed names),
tiling (TiledLinear).
"""
from .convert import partition_module
from .external import register_external_parameter, unregister_external_parameter
from .fetch import FetchOrderError
from .gathered import GatheredParameters
from .init import Init
from .model import ZeroModel
from .param import ZeroParam, is_zero_param, zero_param_of
from .status import TrainingPhase, ZeroParamStatus
from .leaf import (get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module,
                   z3_leaf_parameter)
from .tiling import TiledLinear
from .unpartition import unpartition

__all__ = [
    "Init", "GatheredParameters", "unpartition", "register_external_parameter", "unregister_external_parameter",
    "ZeroParamStatus", "is_zero_param", "ZeroParam", "zero_param_of", "ZeroModel", "FetchOrderError",
    "TrainingPhase", "partition_module", "TiledLinear", "set_z3_leaf_modules", "unset_z3_leaf_modules",
    "get_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter",
]
