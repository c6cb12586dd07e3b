"""DeepSpeed's ``torch_autocast`` section (deepspeed.runtime.torch_autocast's names and behaviour).

- The engine's forward runs under ``torch.autocast(device_type, dtype)`` (``autocast_if_enabled``). An
  autocast already on outside the engine is replaced by the engine's when the engine's is enabled, and
  switched off inside the forward when it is not (DeepSpeed's rule: the engine's precision comes from
  its config alone); either case is said once.
- ``init_autocast_params`` marks each parameter of a lower-precision-safe module (exact class match;
  default torch.nn.Linear and Conv1d/2d/3d) with ``comm_dtype`` = the autocast dtype. The ZeRO reducers
  of stages 1-3 send those gradients in that dtype, one bucket per communication dtype, and ZeRO-3
  all-gathers those parameters in it (the pieces cast down for the gather, the gathered parameter back
  in its own dtype). Stage 0, as DeepSpeed's, reduces every gradient in the usual dtype.
- As DeepSpeed's, whether autocast was initialised and its dtype are process-wide (the last engine
  built with it enabled); the reducers of an engine ask its own config instead.
"""
import contextlib
import importlib
import logging
from typing import Iterable, List, Optional, Sequence, Set

import torch

from .. import comm
from ..config.errors import ConfigError

logger = logging.getLogger("zero_ext")

LOWER_PRECISION_SAFE_MODULES = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d]
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _State:
    initialized = False
    dtype: Optional[torch.dtype] = None
    warned_nested = False


_STATE = _State()


def autocast_dtype_of(config) -> Optional[torch.dtype]:
    """The torch dtype a config's ``torch_autocast`` asks for (None when it names none)."""
    return DTYPES.get(config.torch_autocast.dtype)


def resolve_dtype(config, device_type: str) -> torch.dtype:
    """The autocast dtype, or the device's autocast default when the config names none."""
    return autocast_dtype_of(config) or torch.get_autocast_dtype(device_type)


def get_default_autocast_lower_precision_modules() -> List[str]:
    return [f"{cls.__module__}.{cls.__name__}" for cls in LOWER_PRECISION_SAFE_MODULES]


def import_module_classes(names: Sequence[str]) -> List[type]:
    """The classes named "package.Class"; a name that does not import is a ConfigError naming it."""
    classes = []
    for name in names:
        package, _, cls_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(package), cls_name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"torch_autocast.lower_precision_safe_modules: cannot import {name!r} ({exc}); name "
                              "each class by its module path and class name, e.g. \"torch.nn.Linear\"") from None
        if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
            raise ConfigError(f"torch_autocast.lower_precision_safe_modules: {name!r} is not a torch.nn.Module "
                              "class; list module classes only")
        classes.append(cls)
    return classes


def mark_safe_params(model: torch.nn.Module, dtype: torch.dtype, names: Optional[Sequence[str]]) -> int:
    """Sets ``comm_dtype`` on the parameters of the modules whose class is exactly one of ``names``
    (None: the defaults); returns how many parameters were marked."""
    classes = LOWER_PRECISION_SAFE_MODULES if names is None else import_module_classes(names)
    marked = 0
    for module in model.modules():
        if type(module) in classes:
            for p in module.parameters(recurse=False):
                setattr(p, PARAM_COMM_DTYPE_ATTR_NAME, dtype)
                marked += 1
    return marked


def init_autocast_params(engine, dtype: torch.dtype, torch_autocast_lower_precision_safe_modules=None) -> None:
    """DeepSpeed's: marks ``engine.module``'s safe parameters and records autocast as initialised."""
    if engine.zero_quantized_weights():
        raise ConfigError("torch_autocast.enabled cannot be combined with zero_optimization.zero_quantized_weights; "
                          "turn one off")
    mark_safe_params(engine.module, dtype, torch_autocast_lower_precision_safe_modules)
    _STATE.initialized, _STATE.dtype = True, dtype


def record_initialized(dtype: torch.dtype) -> None:
    _STATE.initialized, _STATE.dtype = True, dtype


def is_autocast_initialized() -> bool:
    return _STATE.initialized


def get_autocast_dtype() -> Optional[torch.dtype]:
    return _STATE.dtype


def has_comm_dtype(param) -> bool:
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param) -> torch.dtype:
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_all_comm_dtypes(params: Iterable) -> Set[torch.dtype]:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: Iterable[torch.dtype]) -> List[torch.dtype]:
    """A fixed order for per-dtype buckets, the same on every rank (DeepSpeed's: by name)."""
    return sorted(dtypes, key=str)


def get_allgather_dtype(param, ds_tensor) -> torch.dtype:
    """The dtype a ZeRO-3 parameter travels in when gathered: its comm_dtype, else its piece's dtype."""
    return get_comm_dtype(param) if has_comm_dtype(param) else ds_tensor.dtype


class AutocastQueries:
    """The engine's torch_autocast accessors (DeepSpeed's names), mixed into ZeroEngine."""

    def torch_autocast_enabled(self) -> bool:
        return self._config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> Optional[torch.dtype]:
        """The forward's autocast dtype; with none configured, the device's autocast default when enabled
        (bf16 on CPU, fp16 on CUDA), else None."""
        if self.torch_autocast_enabled():
            return resolve_dtype(self._config, self.device.type)
        return autocast_dtype_of(self._config)

    def torch_autocast_lower_precision_safe_modules(self) -> List[str]:
        """The configured class names, or DeepSpeed's defaults (Linear, Conv1d/2d/3d) as "module.Class"."""
        names = self._config.torch_autocast.lower_precision_safe_modules
        return get_default_autocast_lower_precision_modules() if names is None else list(names)


def _say_once(message: str, warn: bool) -> None:
    if _STATE.warned_nested:
        return
    _STATE.warned_nested = True
    if comm.get_rank() == 0:
        (logger.warning if warn else logger.info)(message)


@contextlib.contextmanager
def autocast_if_enabled(engine):
    """The engine's forward context (see the module docstring)."""
    device_type = engine.device.type
    outer = torch.is_autocast_enabled(device_type)
    if engine.torch_autocast_enabled():
        if outer:
            _say_once("torch.autocast is already enabled outside the engine; the engine's forward uses its "
                      "torch_autocast config instead", warn=False)
        with torch.autocast(device_type=device_type, dtype=engine.torch_autocast_dtype(), enabled=True):
            yield
    elif outer:
        _say_once("torch.autocast is enabled outside the engine but torch_autocast is off in its config: the "
                  "engine's forward runs without autocast (the bf16/fp16 sections decide its precision). Set "
                  "torch_autocast.enabled to use torch.autocast inside the engine", warn=True)
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    else:
        yield
