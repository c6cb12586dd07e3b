"""Per-module hooks: gather a module's parameters for its forward and its backward, release them after.

[Note: the ZeRO-3 hook scheme]
Only PyTorch's public hook points are used (FSDP2's scheme; nothing is patched):

- forward pre-hook (``prepend=True``, so user hooks see gathered parameters): open a ModuleCall,
  gather the module's own parameters plus those registered as external to it, and -- when autograd
  is recording -- pass the inputs that require grad through ``PostBackward``, an identity
  ``autograd.Function``;
- forward post-hook (``always_call=True``, so an exception in forward still releases and unwinds):
  register a tensor hook on each output that requires grad (the *pre-backward* hook), then release;
  a parameter the forward returns (a bias for the caller to add) is handed up first: external to the
  caller, held by its call (model.py, ``hand_up_returned``), so it stays gathered for the caller;
- pre-backward (an output's gradient has been computed, so the module's backward is next): gather
  again, once per call;
- post-backward (``PostBackward.backward`` runs once the gradients of the module's inputs exist, i.e.
  after the module's backward): release. A module whose inputs need no gradient (the first layer) gets
  no such node; the end-of-backward callback (``queue_callback``, queued by the first pre-backward of
  a backward pass) releases whatever is still held.

The unit is one *call* of the module, not the module: a module run twice in one forward, or run again
under activation checkpointing, has one ModuleCall per run, each holding its parameters from its
pre-hook to its post-hook and again from its pre-backward to its post-backward. Under ``no_grad``
(evaluation, or the first pass of reentrant checkpointing) no autograd machinery is attached at all.

What is gathered when -- on demand, or ahead along the recorded order -- is the prefetch
coordinator's business (coordinator.py): the hooks only tell it that a call needs its parameters and
that it is done with them.

Why gradients are safe: autograd runs ``AccumulateGrad`` for a parameter as soon as its gradient is
complete, ahead of any other ready node, so a parameter is still gathered when its gradient lands
(accumulating into a parameter whose data is empty fails inside autograd). A parameter shared by two
modules is gathered again by the second module's pre-backward before the gradient from that use is
computed.
"""
import functools
from typing import TYPE_CHECKING, List

import torch

from . import internal
from .external import external_parameters, registry_version
from .fetch import FetchSite
from .leaf import z3_leaf_module
from .param import ZeroParam, zero_param_of
from .status import FetchKind, TrainingPhase
from .tree import map_tensors, mappable_tensors, tensors_in

if TYPE_CHECKING:
    from .model import ZeroModel


def returned_params(output) -> List[ZeroParam]:
    """The ZeRO-3 parameters among a forward's outputs, looked for where DeepSpeed looks: the output
    itself, the items of a returned list / tuple, the values of a dict or of an object's attributes."""
    if isinstance(output, torch.Tensor):
        items = [output]
    elif isinstance(output, (list, tuple)):
        items = output
    elif isinstance(output, dict):
        items = output.values()
    else:
        items = getattr(output, "__dict__", {}).values()
    found = {}
    for t in items:
        zp = zero_param_of(t) if isinstance(t, torch.Tensor) else None
        if zp is not None:
            found[id(zp)] = zp
    return list(found.values())


class ModuleCall:
    """One call of a module's forward: the parameters it holds, and its phase."""

    __slots__ = ("state", "params", "phase", "trace_index")

    def __init__(self, state: "ModuleState"):
        self.state = state
        self.params: List[ZeroParam] = []
        self.phase = TrainingPhase.IDLE
        self.trace_index = -1  # the trace event of its current fetch, when following one (coordinator.py)

    def _to(self, phase: TrainingPhase, *allowed: TrainingPhase) -> None:
        if self.phase not in allowed:
            raise RuntimeError(f"zero_ext: {self} cannot go from {self.phase.name} to {phase.name}")
        self.phase = phase

    def to_forward(self) -> None:
        self._to(TrainingPhase.FORWARD, TrainingPhase.IDLE)

    def to_pre_backward(self) -> None:
        self._to(TrainingPhase.PRE_BACKWARD, TrainingPhase.IDLE)

    def to_idle(self) -> None:
        self._to(TrainingPhase.IDLE, TrainingPhase.FORWARD, TrainingPhase.PRE_BACKWARD)

    @property
    def module_index(self) -> int:
        """The module's index in its model (what ``param.ds_active_sub_modules`` lists)."""
        return self.state.index

    def __repr__(self) -> str:
        return f"call of {self.state.name!r} ({self.phase.name})"


class PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward marks the end of the module's backward. Returns
    detached aliases rather than the inputs themselves, so the module may modify them in place."""

    @staticmethod
    def forward(ctx, call: ModuleCall, *inputs: torch.Tensor):
        ctx.call = call
        return tuple(t.detach() for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.call.state.post_backward(ctx.call)
        return (None,) + grads


class ModuleState:
    """The hooks of one module and the knowledge of which parameters it gathers."""

    def __init__(self, model: "ZeroModel", module: torch.nn.Module, index: int, name: str, is_root: bool):
        self.model = model
        self.module = module
        self.index = index
        self.name = name
        self.is_root = is_root
        self._handles = []
        # (external registry version, zero_params()); leaf modules are marked before the hooks are installed
        self._params_cache = (-1, [])

    def register(self) -> None:
        if self._handles:
            return
        self._handles = [
            self.module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
            self.module.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True),
        ]

    def destroy(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def zero_params(self) -> List[ZeroParam]:
        """The ZeRO-3 parameters this module gathers: its own, then those external to it (cached until an
        external parameter is registered or unregistered anywhere)."""
        version, params = self._params_cache
        if version != registry_version():
            params = self._find_params(z3_leaf_module(self.module))  # a leaf gathers its whole subtree (leaf.py)
            self._params_cache = (registry_version(), params)
        return params

    def _find_params(self, leaf: bool) -> List[ZeroParam]:
        found = {}
        for p in self.module.parameters(recurse=leaf):
            zp = zero_param_of(p)
            if zp is not None:
                found[id(zp)] = zp
        for p in external_parameters(self.module):
            zp = zero_param_of(p)
            if zp is not None:
                found[id(zp)] = zp
        return list(found.values())

    def site(self, kind: FetchKind) -> FetchSite:
        return FetchSite(kind, self.index, repr(self.name), self.model.describe_module)

    # -- forward ---------------------------------------------------------------------------------------

    def _pre_forward(self, module, args, kwargs):
        model = self.model
        if self.is_root:
            model.enter_forward()
        params = self.zero_params()
        if not params and not model.detecting:
            return None  # nothing to gather, and no detector to tell whose forward is running
        with internal.section():
            call = ModuleCall(self)
            model.push(call)
            call.to_forward()
            call.params = list(params)
            with internal.labelled(f"zero_ext::pre_forward ({self.name})"):
                model.coordinator.fetch(call, FetchKind.FORWARD)
            if call.params and torch.is_grad_enabled():
                args, kwargs = self._wrap_inputs(call, args, kwargs)
        return args, kwargs

    def _wrap_inputs(self, call: ModuleCall, args, kwargs):
        inputs = [t for t in mappable_tensors((args, kwargs)) if t.requires_grad and t.is_floating_point()]
        if not inputs:
            return args, kwargs
        outputs = PostBackward.apply(call, *inputs)
        replace = {id(t): out for t, out in zip(inputs, outputs)}
        return map_tensors((args, kwargs), lambda t: replace.get(id(t), t))

    def _post_forward(self, module, args, kwargs, output):
        model = self.model
        with internal.section():
            call = model.top()
            if call is not None and call.state is self:  # else our pre-hook never ran (an earlier hook raised)
                model.pop()
                if output is not None and model.top() is not None:
                    for zp in returned_params(output):
                        model.hand_up_returned(zp, module)
                if call.params and output is not None and torch.is_grad_enabled():
                    hook = functools.partial(self.pre_backward, call)
                    for t in tensors_in(output):
                        if t.requires_grad and t.grad_fn is not None:
                            t.register_hook(hook)
                call.to_idle()
                with internal.labelled(f"zero_ext::post_forward ({self.name})"):
                    model.coordinator.release(call)
        if self.is_root:
            model.exit_forward()
        return None

    # -- backward --------------------------------------------------------------------------------------

    def pre_backward(self, call: ModuleCall, grad):
        """Tensor hook on an output: the module's backward is about to run."""
        if call.phase is not TrainingPhase.IDLE:  # gathered already (another output), or still in forward
            return None
        model = self.model
        with internal.section():
            model.queue_end_of_backward()
            call.to_pre_backward()
            model.backward_calls[call] = None
            with internal.labelled(f"zero_ext::pre_backward ({self.name})"):
                model.coordinator.fetch(call, FetchKind.BACKWARD)
        return None

    def post_backward(self, call: ModuleCall) -> None:
        """The gradients of the module's inputs exist: its backward is done."""
        if call.phase is not TrainingPhase.PRE_BACKWARD:
            return
        with internal.section():
            self.model.queue_end_of_backward()
            self.model.backward_calls.pop(call, None)
            call.to_idle()
            with internal.labelled(f"zero_ext::post_backward ({self.name})"):
                self.model.coordinator.release(call)
