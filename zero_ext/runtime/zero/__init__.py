"""DeepSpeed's ``deepspeed.runtime.zero`` import paths.

Files:
- partition_parameters.py: Init, GatheredParameters, ZeroParamStatus, external parameters.
- offload_config.py: OffloadDeviceEnum, OffloadStateTypeEnum; offload_states.py: get_state_devices.
- config.py: DeepSpeedZeroConfig and the offload sections' configs (zero_ext.config's models).
- tiling.py: TiledLinear; mics.py: MiCS_Init; linear.py: LinearModuleForZeroStage3.
- stage_1_and_2.py / stage3.py: the ZeRO-2 / ZeRO-3 memory estimators (utils/estimate.py); stage3.py also
  ``unwrap_model_for_generation`` (zero/generation.py).
- utils.py: is_zero_param.
- linear.py: zero3_linear_wrap, LinearFunctionForZeroStage3 (zero/linear.py).
"""
from ...zero import GatheredParameters, Init, MiCS_Init, ZeroParamStatus, register_external_parameter  # noqa: F401
from ...zero.tiling import TiledLinear  # noqa: F401
from .stage3 import unwrap_model_for_generation  # noqa: F401
