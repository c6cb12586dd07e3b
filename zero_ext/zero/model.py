"""ZeroModel: the ZeRO-3 parameter layer installed on one model.

    zm = ZeroModel(model, param_persistence_threshold=..., model_persistence_threshold=...)
    loss = model(batch); loss.backward()     # parameters gathered and released around each module
    zm.destroy()                             # hooks removed, everything partitioned

It partitions parameters the model still holds whole (a model built without zero.Init), names every
module and parameter (for errors and profiler labels), decides which parameters persist, installs a
ModuleState (hooks.py) on every module, detects external parameters during forward (external.py) and
runs the end-of-backward callback. It is what the engine's stage 3 builds on; the hook points it offers
the engine are ``register_grad_ready_hook`` (a parameter's full gradient is complete: hand it to the
reducer), ``register_backward_end_hook``, ``release_all`` (DeepSpeed's ``empty_partition_cache``) and
``refresh_persistent`` (after the optimizer step changed the pieces).

[Note: whole-model gathered]
When GatheredParameters blocks hold every parameter of the model (``GatheredParameters(model.parameters())``,
TRL's ``unwrap_model_for_generation``, ``zero.generation``), there is nothing to fetch or release, and
nothing to agree on: the module hooks are removed for the block (the GatherMeter tells the model, see
meter.py), so a forward inside it runs exactly as the plain module would -- no per-op detector, no
agreement, no Python per module -- and ranks may run different numbers of forwards (generation of
different lengths). One hook stays on the root: when autograd records, it queues the end-of-backward
callback, so that a backward inside the block still reaches the engine's reducer. The hooks come back
when the block ends. Only a block entered outside the model's forward does this (a block inside a
forward keeps the hooks of the calls already running). ``remove_module_hooks`` / ``register_module_hooks``
do the same by hand (DeepSpeed's hook surface, ds_surface.py); hooks removed by hand stay removed.
"""
import logging
import sys
import weakref
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import torch
from torch.utils.hooks import RemovableHandle

from . import convert, internal
from .coordinator import PrefetchCoordinator
from .ds_surface import install_surface, remove_surface
from .external import (ExternalUseDetector, external_parameters, register_external_parameter,
                       unregister_external_parameter)
from .fetch import FetchSite, fetch, release
from .leaf import z3_leaf_module
from .meter import GatherMeter
from .hooks import ModuleCall, ModuleState
from .param import ZeroParam, zero_param_of
from .quantized_pieces import QuantizedPieces
from .secondary import SecondaryPartition
from .status import FetchKind, ZeroParamStatus
from .tree import tensors_in

logger = logging.getLogger("zero_ext.zero")
_INSTALLED: "weakref.WeakKeyDictionary[torch.nn.Module, ZeroModel]" = weakref.WeakKeyDictionary()


class _Persistent:
    """The holder of persistent parameters."""

    def __repr__(self) -> str:
        return "persistence"


def _in_backward() -> bool:
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover - older torch: assume not
        return False


class ZeroModel:
    """Fetch and release of a model's ZeRO-3 parameters around every module's forward and backward.

    ``param_persistence_threshold`` / ``model_persistence_threshold`` (elements): DeepSpeed's
    ``stage3_param_persistence_threshold`` / ``stage3_model_persistence_threshold``; parameters of at
    most the first size stay gathered on every rank, taken in model order while their total stays
    within the second. ``check_fetch_order``: see [Note: fetch-order agreement] (fetch.py).
    ``detect_external_params``: see [Note: detecting external parameters] (external.py).
    ``group``, ``remote_device``, ``pin_memory``: for parameters that are partitioned here (those the
    model still holds whole). ``prefetch_bucket_size``, ``max_live_parameters``, ``max_reuse_distance``
    (elements; DeepSpeed's stage3_* keys) and ``log_trace_cache_warnings``: the prefetch coordinator,
    see [Note: ZeRO-3 prefetch trace] (coordinator.py). ``quantized_weights``: ZeRO++ qwZ, the
    forward and backward gathers travel as int8 (see [Note: quantized all-gather] in
    quantized_gather.py). ``hpz``: ZeRO++ hpZ, (node group, rank in it, node size) (see [Note: hpZ
    secondary partition] in secondary.py). ``quantized_frozen``: ZeRO++'s quantized non-trainable
    weights, frozen parameters' pieces kept as int8 (quantized_pieces.py). ``meter`` counts the gathered elements of the non-persistent parameters
    (meter.py), ``coordinator.stats`` what was prefetched.
    """

    def __init__(self, module: torch.nn.Module, group=None, param_persistence_threshold: int = 100_000,
                 model_persistence_threshold: int = sys.maxsize, check_fetch_order: bool = True,
                 detect_external_params: bool = True, remote_device=None, pin_memory: bool = False,
                 prefetch_bucket_size: int = 50_000_000, max_live_parameters: int = 1_000_000_000,
                 max_reuse_distance: int = 1_000_000_000, log_trace_cache_warnings: bool = False,
                 quantized_weights: bool = False, hpz=None, quantized_frozen: bool = False):
        if module in _INSTALLED:
            raise RuntimeError(f"zero_ext: ZeRO-3 hooks are already installed on this {type(module).__name__}; "
                               "call destroy() on the first ZeroModel before installing another")
        self.module = module
        self.check_fetch_order = check_fetch_order
        convert.partition_module(module, group, remote_device, pin_memory)
        self._params = self._name_params()
        self.meter = GatherMeter()
        # ZeRO++ hpZ: hpz = (node group, rank in it, node size), see [Note: hpZ secondary partition]
        self.secondary = SecondaryPartition(hpz[2], hpz[0], hpz[1]) if hpz is not None else None
        for zp in self._params:
            zp.attach_meter(self.meter)
            zp.quantize_gathers(quantized_weights)
            zp.attach_secondary(self.secondary)
            if zp.status is not ZeroParamStatus.NOT_AVAILABLE and not zp.persist:
                self.meter.adjust(zp.numel)  # gathered already (an enclosing GatheredParameters)
        # zero_quantized_nontrainable_weights: frozen pieces kept as int8 ([Note: quantized frozen pieces])
        self.frozen_pieces = QuantizedPieces() if quantized_frozen else None
        if self.frozen_pieces is not None:
            for zp in self._params:
                if not zp.param.requires_grad and zp.piece_io is None and zp.status is ZeroParamStatus.NOT_AVAILABLE:
                    self.frozen_pieces.add(zp)
        self._states: Dict[torch.nn.Module, ModuleState] = OrderedDict()
        for index, (name, m) in enumerate(module.named_modules()):
            self._states[m] = ModuleState(self, m, index, name or "<root>", m is module)
        self._module_names = [f"{s.name!r} ({type(s.module).__name__})" for s in self._states.values()]
        self.coordinator = PrefetchCoordinator(self.describe_module, self.meter, check_fetch_order,
                                               prefetch_bucket_size, max_live_parameters, max_reuse_distance,
                                               log_trace_cache_warnings)
        self.coordinator.resident_candidates = self._fetchable
        self._stack: List[ModuleCall] = []
        self.backward_calls: Dict[ModuleCall, None] = {}  # ordered set of calls holding for backward
        self._callback_queued = False
        self._detector = ExternalUseDetector(self._on_use) if detect_external_params else None
        self.detecting = False  # the detector is on (during the forwards of a step that records the trace)
        self._forward_depth = 0
        self._grad_ready_hooks: Dict[int, Callable] = OrderedDict()
        self._backward_end_hooks: Dict[int, Callable] = OrderedDict()
        self._persistent_holder = _Persistent()
        self.persistent = self._mark_persistent(param_persistence_threshold, model_persistence_threshold)
        self._hooks_on = True  # the module hooks are wanted (not removed by hand)
        self._whole = False  # a GatheredParameters block holds every parameter: hooks suspended
        self._whole_handle = None
        self.register_module_hooks()
        self._grad_handles = [zp.param.register_post_accumulate_grad_hook(self._make_grad_hook(zp))
                              for zp in self._params if zp.param.requires_grad]
        self.meter.listener = self._on_pinned
        install_surface(module)
        _INSTALLED[module] = self
        logger.debug("ZeRO-3 hooks on %d modules; %d parameters (%d elements), %d persistent (%d elements)",
                     len(self._states), len(self._params), sum(zp.numel for zp in self._params),
                     len(self.persistent), sum(zp.numel for zp in self.persistent))

    # -- construction ------------------------------------------------------------------------------------

    def _inside_leaf(self, module: torch.nn.Module) -> bool:
        """Whether a leaf module (leaf.py) lies above ``module``; leaves' subtrees are fetched whole."""
        if not hasattr(self, "_leaf_descendants"):
            self._leaf_descendants = set()
            for m in self.module.modules():
                if z3_leaf_module(m):
                    for d in m.modules():
                        if d is not m:
                            self._leaf_descendants.add(id(d))
                    for p in m.parameters():
                        p.ds_z3_leaf_module = True
        return id(module) in self._leaf_descendants

    def _name_params(self) -> List[ZeroParam]:
        params: Dict[int, ZeroParam] = OrderedDict()
        for name, p in self.module.named_parameters():
            zp = zero_param_of(p)
            if zp is not None and id(zp) not in params:
                zp.rename(name)
                params[id(zp)] = zp
        return list(params.values())

    def _mark_persistent(self, param_threshold: int, model_threshold: int) -> List[ZeroParam]:
        chosen, total = [], 0
        for zp in self._params:
            if zp.numel <= param_threshold and total + zp.numel <= model_threshold:
                chosen.append(zp)
                total += zp.numel
        for zp in chosen:
            zp.set_persistent(True)
        fetch(chosen, self._persistent_holder, FetchSite(FetchKind.PERSIST, 0, "<root>", self.describe_module),
              self.check_fetch_order)
        return chosen

    def _make_grad_hook(self, zp: ZeroParam):
        def grad_ready(param):
            for hook in list(self._grad_ready_hooks.values()):
                hook(zp)
        return grad_ready

    def _fetchable(self) -> List[ZeroParam]:
        """Every non-persistent parameter a module call of the model can fetch: the model's own, and those
        registered as external to its modules (what resident decoding holds, resident.py)."""
        found = {id(zp): zp for zp in self._params}
        for state in self._states.values():
            for zp in state.zero_params():
                found.setdefault(id(zp), zp)
        return [zp for zp in found.values() if not zp.persist]

    # -- what the hooks use ------------------------------------------------------------------------------

    def describe_module(self, index: int) -> str:
        return self._module_names[index] if 0 <= index < len(self._module_names) else f"#{index}"

    @property
    def params(self) -> List[ZeroParam]:
        return list(self._params)

    def state_of(self, module: torch.nn.Module) -> ModuleState:
        return self._states[module]

    def push(self, call: ModuleCall) -> None:
        self._stack.append(call)

    def pop(self) -> ModuleCall:
        return self._stack.pop()

    def top(self) -> Optional[ModuleCall]:
        return self._stack[-1] if self._stack else None

    def enter_forward(self) -> None:
        """The root's forward begins (nested calls of the root count once)."""
        if self._forward_depth == 0:
            if self._callback_queued and not _in_backward():
                self._end_of_backward()  # the last backward raised before its callback ran
            with internal.section():
                self.coordinator.begin_step()
            self.drop_secondary()  # a forward gathers afresh: pieces may have changed since the last
            # the detector runs while the trace is recorded only (see [Note: detecting external parameters])
            if self._detector is not None and self.coordinator.is_recording():
                self._detector.__enter__()
                self.detecting = True
        self._forward_depth += 1

    def exit_forward(self) -> None:
        self._forward_depth -= 1
        if self._forward_depth == 0:
            self._stack.clear()
            if self.detecting:
                self.detecting = False
                self._detector.__exit__(None, None, None)
            with internal.section():
                if torch.is_grad_enabled():
                    self.coordinator.checkpoint()  # before any collective of the user's (a logged loss)
                else:
                    self.coordinator.end_step(repeat=True)  # no backward follows; the next forward may repeat it

    def _on_use(self, zp: ZeroParam) -> None:
        """The detector saw ``zp`` passed to a torch function during forward."""
        call = self.top()
        if call is None or zp.persist or zp.held_by(call):
            return
        module = call.state.module
        logger.debug("%s is used in the forward of %r: registered as external to it", zp.name, call.state.name)
        register_external_parameter(module, zp.param)
        call.params.append(zp)
        with internal.section():
            self.coordinator.fetch(call, FetchKind.EXTERNAL, [zp])

    def hand_up_returned(self, zp: ZeroParam, child: torch.nn.Module) -> None:
        """``zp`` is in what ``child``'s forward returned (a bias left for the caller to add): as in
        DeepSpeed, it becomes external to the innermost module still running, whose call holds it, so it
        stays gathered when ``child`` releases. Nothing changes when a running call holds it already (from
        the next step on: the caller's own gather)."""
        caller = self.top()
        if caller is None or zp.persist or any(zp.held_by(c) for c in self._stack):
            return
        if any(p is zp.param for p in external_parameters(child)):  # handed up once more: the outer caller's now
            unregister_external_parameter(child, zp.param)
        logger.debug("%s is returned by the forward of %r: registered as external to %r", zp.name,
                     type(child).__name__, caller.state.name)
        register_external_parameter(caller.state.module, zp.param)
        caller.params.append(zp)
        with internal.section():
            self.coordinator.fetch(caller, FetchKind.EXTERNAL, [zp])

    def queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        with internal.section():
            for call in list(self.backward_calls):
                call.to_idle()
                call.trace_index = -1
                release(call.params, call)
            self.backward_calls.clear()
            self.coordinator.end_step()  # checked, and nothing kept gathered into the optimizer step
        for hook in list(self._backward_end_hooks.values()):
            hook()

    # -- whole-model gathered (see [Note: whole-model gathered]) -------------------------------------------

    def _on_pinned(self) -> None:
        whole = bool(self._params) and self.meter.pinned >= len(self._params)
        if whole and not self._whole and self._forward_depth == 0:
            self._whole = True
            self._unregister_states()
            self._whole_handle = self.module.register_forward_hook(self._whole_forward_done, always_call=True)
        elif not whole and self._whole:
            self._leave_whole()
            if self._hooks_on:
                self._register_states()

    def _leave_whole(self) -> None:
        self._whole = False
        if self._whole_handle is not None:
            self._whole_handle.remove()
            self._whole_handle = None

    def _whole_forward_done(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(self._queue_from_grad)
        return None

    def _queue_from_grad(self, grad) -> None:
        self.queue_end_of_backward()
        return None

    @property
    def hooks_active(self) -> bool:
        """Whether the module hooks run now (not removed by hand, not suspended by a whole-model block)."""
        return self._hooks_on and not self._whole

    def register_module_hooks(self) -> None:
        """Install the module hooks (again, after ``remove_module_hooks``); inside a whole-model block they
        take over from the block's suspension."""
        self._hooks_on = True
        if self._whole:
            self._leave_whole()
        self._register_states()

    def remove_module_hooks(self) -> None:
        """Remove the module hooks until ``register_module_hooks``: forwards then use whatever the
        parameters hold (gather them first, e.g. GatheredParameters over the model)."""
        self._hooks_on = False
        self._unregister_states()

    def _register_states(self) -> None:
        for state in self._states.values():
            if not self._inside_leaf(state.module):  # a leaf's descendants have no hooks of their own
                state.register()

    def _unregister_states(self) -> None:
        for state in self._states.values():
            state.destroy()

    # -- hook points for the engine ----------------------------------------------------------------------

    def register_grad_ready_hook(self, hook: Callable[[ZeroParam], None]) -> RemovableHandle:
        """``hook(zero_param)`` runs once per backward for each trainable parameter, when its full
        gradient has been accumulated into ``param.grad`` (a post-accumulate-grad hook): where the
        reducer takes the gradient, reduce-scatters it into the pieces and clears ``param.grad``."""
        handle = RemovableHandle(self._grad_ready_hooks)
        self._grad_ready_hooks[handle.id] = hook
        return handle

    def register_backward_end_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """``hook()`` runs at the end of each backward pass, after the leftover parameters were released."""
        handle = RemovableHandle(self._backward_end_hooks)
        self._backward_end_hooks[handle.id] = hook
        return handle

    def verify_fetch_order(self) -> None:
        """Call before a collective of the engine's own during backward (a gradient reduction): ranks
        confirm the fetches they made along the trace without a collective, so that one that left it
        raises FetchOrderError here rather than meeting a reduction with a gather. Cheap when there is
        nothing to confirm. See [Note: checking the order along the trace] (coordinator.py)."""
        with internal.section():
            self.coordinator.checkpoint()

    def release_all(self, include_persistent: bool = True) -> None:
        """Partition every parameter no module call or GatheredParameters context holds (DeepSpeed's
        ``empty_partition_cache``). Persistent parameters are gathered again on their next use."""
        with internal.section():
            self.coordinator.drain()
            for call in list(self.backward_calls):
                call.to_idle()
                release(call.params, call)
            self.backward_calls.clear()
            if include_persistent:
                release(self.persistent, self._persistent_holder)
                for zp in self.persistent:
                    if zp.status is ZeroParamStatus.AVAILABLE and not zp.holders:
                        zp.to_partitioned()

    def drop_secondary(self) -> None:
        """hpZ: forget the node-local copies (after an optimizer step; when a forward begins)."""
        if self.secondary is not None:
            self.secondary.invalidate()

    def refresh_persistent(self) -> None:
        """Gather persistent parameters again from their pieces (after an optimizer step). Collective."""
        self.coordinator.end_residency(check=True)  # (collective, as this is: see [Note: resident decoding])
        self.coordinator.drain()  # nothing gathered may outlive the pieces it was gathered from
        release(self.persistent, self._persistent_holder)
        for zp in self.persistent:
            if zp.status is ZeroParamStatus.AVAILABLE and not zp.holders:
                zp.to_partitioned()
        fetch(self.persistent, self._persistent_holder,
              FetchSite(FetchKind.PERSIST, 0, "<root>", self.describe_module), self.check_fetch_order)

    def destroy(self) -> None:
        """Remove every hook and partition everything; the parameters stay ZeRO-3 parameters (usable
        with GatheredParameters, or with a new ZeroModel)."""
        self._unregister_states()
        self._leave_whole()
        self.meter.listener = None
        remove_surface(self.module)
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles = []
        if self.detecting:
            self.detecting = False
            self._detector.__exit__(None, None, None)
        self._forward_depth = 0
        self.release_all(include_persistent=True)
        for zp in self.persistent:
            zp.set_persistent(False)
        self.persistent = []
        for zp in self._params:
            zp.attach_meter(None)
            zp.quantize_gathers(False)
            zp.attach_secondary(None)
        if self.secondary is not None:
            self.secondary.destroy()
        if self.frozen_pieces is not None:  # the pieces become tensors again (their dequantized values)
            self.frozen_pieces.release_all()
        _INSTALLED.pop(self.module, None)
