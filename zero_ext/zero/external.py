"""External parameters: parameters a module uses in its forward without owning them.

A module's hooks gather the parameters it owns; a parameter it reads from elsewhere -- an embedding
weight used again for the logits, a bias returned by a child's forward and added by the caller -- is
"external" to it, and must be gathered with it too, in forward and again in backward. Such parameters
are registered per module here, either by hand (``register_external_parameter``, DeepSpeed's API) or
automatically by the ExternalUseDetector.

[Note: detecting external parameters]
DeepSpeed detects them by replacing every module's ``_parameters`` dict with a subclass whose
``__getitem__`` gathers: an attribute read can start a collective. zero_ext uses a documented hook
instead: while the root module's forward runs, a ``TorchFunctionMode`` sees every torch function call;
when an argument is a ZeRO-3 parameter that the module on top of the call stack does not hold, it is
a use outside its owner, and the model gathers it for that call and registers it as external to that
module (so that later forwards and the backward gather it up front). Property reads (``p.shape``,
``p.requires_grad``) are not uses. The mode is pushed by the root's forward pre-hook and popped by its
always-called post-hook, blind to zero_ext's own work (internal.py), and absent outside the forward: code
outside the model's forward must gather with GatheredParameters. Its cost is one Python call per
torch function during forward, so it runs only in the steps that record the fetch trace (the first step,
and the step after the trace changed, coordinator.py): what it registers there is gathered by the module
hooks in every later step. A use that appears only after the trace was recorded, without any change in
which modules run (data-dependent code inside one module), is not seen: the op then meets the empty
partitioned parameter and torch raises its shape error; register such a parameter by hand.
``detect_external_params=False`` turns the detector off (then register by hand).
"""
import weakref
from types import MappingProxyType
from typing import Callable, Dict, Iterator, List, Mapping

import torch
from torch.overrides import TorchFunctionMode

from . import internal
from .param import ZeroParam, zero_param_of

_EXTERNAL: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[int, torch.nn.Parameter]]" = weakref.WeakKeyDictionary()
_VERSION = [0]  # bumped by every registration and unregistration (the hooks cache what a module gathers)


def registry_version() -> int:
    return _VERSION[0]


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Gather ``parameter`` whenever ``module``'s forward or backward runs, as if ``module`` owned it.
    For uses the detector cannot see (e.g. inside code that runs outside torch functions)."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("register_external_parameter: parameter must be a torch.nn.Parameter, not "
                           f"{type(parameter).__name__}")
    if not isinstance(module, torch.nn.Module):
        raise RuntimeError(f"register_external_parameter: module must be a torch.nn.Module, not "
                           f"{type(module).__name__}")
    params = _EXTERNAL.get(module)
    if params is None:
        params = _EXTERNAL[module] = {}
    params[id(parameter)] = parameter
    _VERSION[0] += 1


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo ``register_external_parameter`` (also for parameters registered automatically)."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("unregister_external_parameter: parameter must be a torch.nn.Parameter, not "
                           f"{type(parameter).__name__}")
    params = _EXTERNAL.get(module)
    if not params or id(parameter) not in params:
        name = getattr(parameter, "ds_id", None)
        raise RuntimeError(f"unregister_external_parameter: parameter (ds_id={name}) is not registered as "
                           f"external to module {type(module).__name__}")
    del params[id(parameter)]
    _VERSION[0] += 1


def external_view(module: torch.nn.Module) -> Mapping[int, torch.nn.Parameter]:
    """A live read-only view of ``module``'s external parameters, keyed by ``id(parameter)`` (DeepSpeed's
    ``module._external_params``)."""
    return MappingProxyType(_EXTERNAL.setdefault(module, {}))


def external_parameters(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters registered as external to ``module``, in registration order."""
    params = _EXTERNAL.get(module)
    return list(params.values()) if params else []


def tensor_args(args, kwargs) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, and inside its list / tuple arguments."""
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, torch.Tensor):
                yield a
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        yield b


class ExternalUseDetector(TorchFunctionMode):
    """Reports each ZeRO-3 parameter passed to a torch function (see [Note: detecting external
    parameters]); ``on_use(zero_param)`` decides whether the use is external."""

    _DESCRIPTORS = ("__get__", "__set__")

    def __init__(self, on_use: Callable[[ZeroParam], None]):
        super().__init__()
        self.on_use = on_use

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not internal.active() and getattr(func, "__name__", "") not in self._DESCRIPTORS:
            for t in tensor_args(args, kwargs):
                zp = zero_param_of(t)
                if zp is not None:
                    self.on_use(zp)
        return func(*args, **kwargs)
