"""``deepspeed.runtime.config.DeepSpeedConfig``: DeepSpeed's config object, over zero_ext.config.

    cfg = DeepSpeedConfig("ds_config.json")          # or a dict, or base64 JSON text
    cfg.train_batch_size, cfg.zero_optimization_stage, cfg.zero_config.offload_optimizer, ...

Loading is zero_ext's ``load_config`` (every key validated; unknown keys are errors with a suggestion,
where DeepSpeed ignores them), and the batch triple is resolved for the data-parallel world size as
DeepSpeed does: ``mpu.get_data_parallel_world_size()`` when an mpu is given, else the world size of an
initialised process group, else 1. The attributes below are the ones scripts and libraries read;
``config`` is zero_ext's own validated model (zero_ext.config.DeepSpeedConfig) for everything else.
"""
from typing import Any, Dict, Optional, Union

from ..comm import get_rank, get_world_size, is_initialized
from ..config import ConfigError, load_config
from ..config.batch import resolve_batch
from ..precision.autocast import autocast_dtype_of
from .eigenvalue import eigenvalue_settings


# DeepSpeed's optimizer type names (config "optimizer.type", compared lower-case)
ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER = "adagrad", "adam", "adamw", "lamb"
ONEBIT_ADAM_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER = "onebitadam", "zerooneadam", "onebitlamb"
MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER = "muadam", "muadamw", "musgd"
LION_OPTIMIZER, MUON_OPTIMIZER = "lion", "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER,
                        ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER,
                        MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]
TORCH_ADAM_PARAM, ADAM_W_MODE, ADAM_W_MODE_DEFAULT = "torch_adam", "adam_w_mode", True


def get_log_level(param_dict: Dict[str, Any]) -> Optional[str]:
    """The config dict's ``log_level`` (None when absent)."""
    return param_dict.get("log_level")


DeepSpeedConfigError = ConfigError  # DeepSpeed's name; what a bad config raises here (a ValueError)


class DeepSpeedConfig:
    """A DeepSpeed config, loaded and checked (``DeepSpeedConfig(config, mpu=None, mesh_device=None)``)."""

    def __init__(self, config: Union[str, Dict[str, Any]], mpu=None, mesh_device=None):
        if mesh_device is not None:
            raise NotImplementedError("DeepSpeedConfig(mesh_device=...): zero_ext has no device mesh (data-parallel "
                                      "ZeRO only); pass mpu=None and let the world size be the process group's")
        self.config = load_config(config)
        self._param_dict = self.config.raw
        self.global_rank = get_rank() if is_initialized() else 0
        if mpu is not None:
            self.world_size = int(mpu.get_data_parallel_world_size())
        else:
            self.world_size = get_world_size() if is_initialized() else 1
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = \
            self.config.resolve_batch(self.world_size)
        self.__dict__.update(eigenvalue_settings(self._param_dict))  # eigenvalue_enabled, ... (eigenvalue.py)

    def _configure_train_batch_size(self) -> None:
        """Re-derive the batch triple from the three attributes as they are now (None: not given), as
        DeepSpeed's method of this name does; an inconsistent triple raises ConfigError (an AssertionError,
        DeepSpeed's type here)."""
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = \
            resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                          self.gradient_accumulation_steps, self.world_size)

    # -- what people read -------------------------------------------------------------------------
    @property
    def zero_config(self):
        """The ``zero_optimization`` section (DeepSpeedZeroConfig = zero_ext.config.ZeroConfig)."""
        return self.config.zero_optimization

    @property
    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    @property
    def zero_enabled(self) -> bool:
        return self.config.zero_optimization.stage > 0

    @property
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    @property
    def float16_config(self):
        return self.config.fp16

    @property
    def bfloat16_config(self):
        return self.config.bf16

    @property
    def loss_scale(self) -> float:
        return self.config.fp16.loss_scale if self.config.fp16.enabled else 1.0

    @property
    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    @property
    def torch_autocast_dtype(self):
        """The configured autocast dtype as a torch dtype (None when not given), as DeepSpeed's."""
        return autocast_dtype_of(self.config)

    @property
    def torch_autocast_lower_precision_safe_modules(self):
        return self.config.torch_autocast.lower_precision_safe_modules

    @property
    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    @property
    def optimizer_name(self) -> Optional[str]:
        opt = self.config.optimizer
        return None if opt is None else str(opt.type).lower()

    @property
    def optimizer_params(self) -> Optional[Dict[str, Any]]:
        opt = self._param_dict.get("optimizer")
        return None if not opt else opt.get("params")

    @property
    def scheduler_name(self) -> Optional[str]:
        sched = self.config.scheduler
        return None if sched is None else sched.type

    @property
    def scheduler_params(self) -> Optional[Dict[str, Any]]:
        sched = self._param_dict.get("scheduler")
        return None if not sched else sched.get("params")

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "config":
            raise AttributeError(name)
        cfg = self.__dict__.get("config")
        if cfg is not None and name in type(cfg).model_fields:  # a top-level key: steps_per_print, ...
            return getattr(cfg, name)
        raise AttributeError(f"zero_ext's DeepSpeedConfig (zero_ext/runtime/config.py) has no '{name}'; the whole "
                             "validated config is .config (zero_ext.config.DeepSpeedConfig), the dict as given "
                             "._param_dict")

    def print(self, name: str = "DeepSpeedConfig") -> None:
        """Logs the config as given, as DeepSpeed's does (at info level, on the zero_ext logger)."""
        import json
        import logging

        logging.getLogger("zero_ext").info("%s:\n%s", name, json.dumps(self._param_dict, indent=4, default=str))


__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "get_log_level", "DEEPSPEED_OPTIMIZERS", "TORCH_ADAM_PARAM",
           "ADAM_W_MODE", "ADAM_W_MODE_DEFAULT"] + [name for name in dir() if name.endswith("_OPTIMIZER")]
