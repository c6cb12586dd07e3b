"""``deepspeed.runtime.zero``."""
from zero_ext.runtime.zero import (GatheredParameters, Init, TiledLinear, ZeroParamStatus,  # noqa: F401
                                   register_external_parameter)
from . import (config, offload_config, offload_states, partition_parameters, stage3, stage_1_and_2,  # noqa: F401
               tiling, utils)
from .stage3 import unwrap_model_for_generation  # noqa: F401
