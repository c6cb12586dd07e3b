"""DeepSpeed's ZeRO-3 hook surface, as libraries reach for it (TRL's ``unwrap_model_for_generation``).

TRL gathers the whole model, then removes and re-adds DeepSpeed's hooks through
``engine.zero_optimizer.parameter_offload`` (DeepSpeed's ``DeepSpeedZeRoOffload``):

- ``.module``; ``.forward_hooks`` / ``.backward_hooks``: lists of handles it calls ``remove()`` on and
  then replaces by empty lists; ``._register_deepspeed_module(module)``: put the hooks back;
- ``.param_coordinator``: ``is_invalid_trace()``, ``_invalidate_trace()`` (a trace recorded with the
  hooks may not hold after generation forwards without them);
- ``module.ds_external_parameters()``: (name, parameter) pairs of the parameters registered as external
  to a module (``module._external_params``: the same, DeepSpeed's read-only dict by ``id(parameter)``);
  ``param.ds_active_sub_modules``: the module calls holding it (param.py, ActiveSubModules).

Here these are a view of ZeroModel's real hooks: one handle in ``forward_hooks`` stands for all module
hooks (removing it is ``ZeroModel.remove_module_hooks``), and ``backward_hooks`` is empty, because our
backward hooks are attached by the forward ones (hooks.py) and leave with them.
"""
import functools
from typing import Iterator, List, Tuple

import torch

from .external import external_parameters, external_view

_SURFACE_ATTR = "ds_external_parameters"
_VIEW_ATTR = "_external_params"


def _external_pairs(module: torch.nn.Module) -> List[Tuple[str, torch.nn.Parameter]]:
    return [(str(getattr(p, "ds_id", id(p))), p) for p in external_parameters(module)]


def install_surface(root: torch.nn.Module) -> None:
    """``ds_external_parameters()`` and ``_external_params`` on ``root`` and each of its modules."""
    for m in root.modules():
        if _SURFACE_ATTR not in m.__dict__:
            m.__dict__[_SURFACE_ATTR] = functools.partial(_external_pairs, m)
        m.__dict__.setdefault(_VIEW_ATTR, external_view(m))


def remove_surface(root: torch.nn.Module) -> None:
    for m in root.modules():
        m.__dict__.pop(_SURFACE_ATTR, None)
        m.__dict__.pop(_VIEW_ATTR, None)


class _ModuleHooksHandle:
    """The handle TRL removes: all of the model's module hooks."""

    def __init__(self, zero_model):
        self._zero_model = zero_model

    def remove(self) -> None:
        self._zero_model.remove_module_hooks()

    def __repr__(self) -> str:
        return f"ZeRO-3 module hooks of {type(self._zero_model.module).__name__}"


class CoordinatorView:
    """DeepSpeed's ``PartitionedParameterCoordinator`` trace calls, over our PrefetchCoordinator."""

    def __init__(self, coordinator):
        self._coordinator = coordinator

    def is_invalid_trace(self) -> bool:
        return self._coordinator.is_invalid()

    def is_complete_trace(self) -> bool:
        return self._coordinator.is_complete()

    def is_record_trace(self) -> bool:
        return self._coordinator.is_recording()

    def _invalidate_trace(self) -> None:
        self._coordinator.invalidate("invalidated by the caller (hooks removed and added again)")

    def reset_step(self) -> None:
        self._coordinator.drain()


class ParameterOffload:
    """``engine.zero_optimizer.parameter_offload`` at stage 3 (see the module docstring)."""

    def __init__(self, zero_model):
        self._zero_model = zero_model
        self.module = zero_model.module
        self.param_coordinator = CoordinatorView(zero_model.coordinator)
        self.forward_hooks: List[_ModuleHooksHandle] = [_ModuleHooksHandle(zero_model)]
        self.backward_hooks: List = []

    def _register_deepspeed_module(self, module: torch.nn.Module, count=None) -> None:
        if module is not self.module:
            raise ValueError("parameter_offload._register_deepspeed_module: zero_ext installs hooks on the "
                             f"engine's whole model ({type(self.module).__name__}), not on a "
                             f"{type(module).__name__} alone")
        self._zero_model.register_module_hooks()
        self.forward_hooks = [_ModuleHooksHandle(self._zero_model)]

    def get_param_coordinator(self) -> CoordinatorView:
        return self.param_coordinator

    def partition_all_parameters(self) -> None:
        self._zero_model.release_all(include_persistent=False)

    def empty_partition_cache(self) -> None:
        self._zero_model.release_all(include_persistent=True)

    def iter_params(self) -> Iterator[torch.nn.Parameter]:
        return iter(self.module.parameters())
