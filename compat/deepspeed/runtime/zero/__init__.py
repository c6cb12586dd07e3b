"""``deepspeed.runtime.zero``."""
from zero_ext.runtime.zero import (GatheredParameters, Init, MiCS_Init, TiledLinear, ZeroParamStatus,  # noqa: F401
                                   register_external_parameter)
from . import (config, leaf_module_config, linear, mics, offload_config, offload_states, partition_parameters, stage3,  # noqa: F401
               stage_1_and_2,
               tiling, utils)
from .stage3 import unwrap_model_for_generation  # noqa: F401
