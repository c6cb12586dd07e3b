"""zero_ext: a ZeRO (Zero Redundancy Optimizer) engine for PyTorch with DeepSpeed's API and config.

    import zero_ext as deepspeed
    deepspeed.init_distributed()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config)

`import zero_ext` needs neither CUDA nor NCCL: the CUDA library is loaded only when CUDA tensors are used.
"""
import importlib.metadata

from .comm import add_config_arguments, init_distributed
from .engine import ZeroEngine
from .initialize import initialize
from .offload.states import OffloadDeviceEnum, OffloadStateTypeEnum
from . import utils  # noqa: F401  (zero_ext.utils.safe_get_full_grad, ... as deepspeed.utils)
from . import zero  # noqa: F401  (zero_ext.zero.Init, GatheredParameters, ... as deepspeed.zero)
from . import activation_checkpointing as checkpointing  # noqa: F401  (deepspeed.checkpointing)

DeepSpeedEngine = ZeroEngine  # DeepSpeed's name, for isinstance checks in ported code

__version__ = importlib.metadata.version("zero_ext")  # pyproject.toml's, the one place it is written

__all__ = ["init_distributed", "add_config_arguments", "initialize", "ZeroEngine", "DeepSpeedEngine", "OffloadDeviceEnum",
           "OffloadStateTypeEnum", "checkpointing", "__version__"]
