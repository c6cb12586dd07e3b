"""zero.Init: partition each module's parameters as soon as its constructor returns.

    with zero_ext.zero.Init(config_dict_or_path=ds_config):
        model = MyLargeModel()        # no rank ever holds more than its pieces plus one module

[Note: zero.Init construction tracking]
DeepSpeed wraps ``__init__`` of every ``nn.Module`` subclass (and patches ``__init_subclass__``) to
learn when a constructor returns. zero_ext watches construction through documented hooks only:

- ``register_module_parameter_registration_hook``: every parameter registered on any module while
  Init is active is recorded as *pending*, together with its *anchor*, the innermost module whose
  ``__init__`` is running at that moment (found by walking the Python call stack: a frame of a function
  named ``__init__`` whose first argument is an ``nn.Module``). Usually the anchor is the registering
  module itself; a parameter a parent registers on a finished child is anchored to the parent.
- A ``TorchFunctionMode`` sees every torch call. Before each one, pending parameters whose anchor's
  ``__init__`` is no longer on the stack are partitioned (convert.py: rank 0's value cut into pieces):
  a parameter is partitioned at the first torch call after its constructor returns, and in particular
  before the next allocation. So a rank holds at most its pieces plus the parameters of the modules
  still under construction (the chain of constructors on the stack: in practice one module) -- the
  bound test_zero_memory.py measures. For factory calls (``torch.empty``, ``randn``, ``zeros_like``,
  ...) the same mode supplies the local device and, when Init has a dtype, casts new floating-point
  tensors to it (DeepSpeed's tensor overrides).
- ``copy.deepcopy`` of a pending parameter (``nn.TransformerEncoder`` deep-copies the finished layer it
  is given) partitions it first when its constructor has returned, then copies the piece: the
  registration hook gives the parameter an instance ``__deepcopy__``, which ZeroParam replaces by its
  own (see [Note: the ds_* facade] in param.py).
- ``register_module_buffer_registration_hook`` moves buffers to the local device (buffers are never
  partitioned).
- Parameters registered outside any constructor (``model.extra = Parameter(...)`` in the ``with``
  block) are partitioned when the outermost Init exits.
- DeepSpeed's ds_* attributes answer as soon as a module's constructor has returned (DeepSpeed
  partitions at the end of ``__init__``; ``m = nn.Linear(...)`` then ``m.weight.ds_tensor``, or a parent
  constructor reading a child's ``ds_id``, must see the partition). A pending parameter therefore
  takes a subclass of its own class (``pending_class``) whose ``__getattr__`` -- reached only for an
  attribute the parameter lacks, so nothing else pays -- partitions the ready pending parameters on a
  ``ds_*`` name and then answers it; while its own constructor still runs the name stays missing,
  as in DeepSpeed. The class goes back before the parameter is partitioned (or left whole).

A constructor's own edits, and a subclass ``__init__`` editing what its base class registered, happen
before partitioning, since the anchor's ``__init__`` is still running. Everything that touches a
parameter after it was partitioned -- a parent's ``self.apply(init_fn)`` or ``nn.init`` call,
transformers' ``post_init``, code in the ``with`` block -- is run by the same mode on the full value,
exactly as the plain constructor would (materialise.py, [Note: exact initialisation under zero.Init]).
Init patches nothing in torch (``override_module_apply`` is accepted and has nothing left to switch).
Modules built with ``torch.nn.utils.skip_init`` are made on the meta device and given fresh
parameters by ``to_empty``, outside the registration hooks: a pending parameter on the meta device
waits, and the one that replaced it in its module is partitioned in its place.
"""
import contextlib
import functools
import sys
import warnings
import weakref
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.overrides import TorchFunctionMode

from .. import comm
from ..config import load_config
from ..nvme.pieces import NVMePieces
from ..nvme.store import NVMeStateStore
from ..nvme.swap_dir import check_nvme_path
from . import convert, guard, internal
from .materialise import Materialiser
from .param import is_zero_param, zero_param_of
from .mics import mics_groups

_ACTIVE: Optional["_InitSession"] = None  # the outermost active Init's state

# Factories that take a device= argument (Init supplies the local device when none is given) ...
_DEVICE_FACTORIES = frozenset([
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint, torch.randperm,
    torch.arange, torch.linspace, torch.logspace, torch.eye, torch.tensor, torch.empty_strided, torch.as_tensor,
])
# ... and all allocating factories, before which finished modules are partitioned.
_FACTORIES = _DEVICE_FACTORIES | frozenset([
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
    torch.Tensor.new_full, torch.Tensor.new_tensor,
])


# -- construction tracking ----------------------------------------------------------------------------

def constructing_modules() -> List[torch.nn.Module]:
    """The modules whose ``__init__`` is running, innermost first (see [Note: zero.Init construction
    tracking])."""
    found = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_argcount:
            obj = frame.f_locals.get(code.co_varnames[0])
            if isinstance(obj, torch.nn.Module):
                found.append(obj)
        frame = frame.f_back
    return found


class _Pending(NamedTuple):
    param: "weakref.ref[torch.nn.Parameter]"
    anchor: Optional[torch.nn.Module]  # the module whose constructor must return first (None: Init's exit)
    module: "weakref.ref[torch.nn.Module]"  # where it was registered, under ``name``
    name: str

    def current(self) -> Optional[torch.nn.Parameter]:
        """The parameter, or the one that replaced it in its module without being registered again:
        ``Module._apply`` puts a new Parameter in ``_parameters`` when the device changes kind, as
        ``skip_init``'s ``to_empty`` does to a module built on the meta device."""
        param, module = self.param(), self.module()
        if module is not None:
            now = module._parameters.get(self.name)
            if now is not None and now is not param and not is_zero_param(now):
                return now
        return param


_NOT_REACHED = Materialiser.NOT_REACHED
_PLAIN = torch._C._disabled_torch_function_impl  # Parameter's __torch_function__
_PENDING_CLASSES = {}


def _pending_getattr(self, name: str):
    """A ds_* attribute of a pending parameter: partition what is ready (this parameter, once its
    constructor has returned), then answer from its facade."""
    session = _ACTIVE
    if name.startswith("ds_") and session is not None and not internal.active():
        session.flush(final=False)
        if is_zero_param(self):
            return object.__getattribute__(self, name)
    raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


def pending_class(cls: type) -> type:
    """The class a parameter of class ``cls`` takes while zero.Init has it pending (``cls`` itself when
    it defines its own ``__torch_function__``: a tensor subclass keeps its class)."""
    pending = _PENDING_CLASSES.get(cls)
    if pending is None:
        if cls.__torch_function__ is not _PLAIN or cls in _PENDING_CLASSES.values():
            return cls
        pending = type(cls.__name__, (cls,), {"__getattr__": _pending_getattr, "_zero_pending_of": cls,
                                              "__module__": cls.__module__,
                                              "__doc__": cls.__doc__})
        _PENDING_CLASSES[cls] = pending
    return pending


def _restore_class(param: torch.nn.Parameter) -> None:
    """Back to the parameter's own class (before it is partitioned, or when it is left whole)."""
    own = type(param).__dict__.get("_zero_pending_of")
    if own is not None:
        param.__class__ = own


class _ConstructionMode(TorchFunctionMode):
    def __init__(self, session: "_InitSession"):
        super().__init__()
        self.session = session

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if internal.active():
            return func(*args, **kwargs)
        session = self.session
        if session.pending:
            session.flush(final=False)
        factory = func in _FACTORIES
        if factory and func in _DEVICE_FACTORIES and kwargs.get("device") is None and session.device.type != "cpu":
            kwargs = dict(kwargs, device=session.device)
        result = session.materialiser.call(func, args, kwargs)  # [Note: exact initialisation under zero.Init]
        if result is _NOT_REACHED:
            result = func(*args, **kwargs)
        if (factory and session.dtype is not None and isinstance(result, torch.Tensor) and result.is_floating_point()
                and result.dtype != session.dtype):
            result = result.to(session.dtype)
        return result


class _InitSwap:
    """remote_device "nvme": one swap store for the pieces this Init makes, opened at the first one (each
    piece is written and its host memory released as soon as its module is built; initialize moves the
    trainable ones into the engine's sub-group files, nvme/pieces.py)."""

    def __init__(self, section, aio):
        self.section, self.aio, self._pieces = section, aio, None

    def pieces(self):
        if self._pieces is None:
            check_nvme_path(self.section.nvme_path)
            store = NVMeStateStore(self.section.nvme_path, self.section.buffer_count, aio=self.aio,
                                   pin_memory=self.section.pin_memory)
            self._pieces = NVMePieces(store, self.section.max_in_cpu)
        return self._pieces


class _InitSession:
    """What the outermost active Init installed, and the parameters waiting to be partitioned."""

    def __init__(self, init: "Init"):
        self.group, self.device, self.dtype = init.group, init.device, init.dtype
        self.remote_device, self.pin_memory = init.remote_device, init.pin_memory
        self.nvme = init.nvme  # remote_device "nvme": the pieces go to swap files as they are made
        self.sanity_checks, self.gather_by_all_reduce = init.sanity_checks, init.gather_by_all_reduce
        self.depth = 0  # nested Init contexts inside this one
        self.pending: List[_Pending] = []
        self.materialiser = Materialiser()
        self.mode = _ConstructionMode(self)
        self.handles = []

    def open(self) -> None:
        self.handles = [register_module_parameter_registration_hook(self._on_parameter),
                        register_module_buffer_registration_hook(self._on_buffer)]
        self.mode.__enter__()
        guard.init_opened(True)

    def close(self, flush: bool) -> None:
        guard.init_opened(False)
        self.mode.__exit__(None, None, None)
        try:
            self.materialiser.finish(ok=flush)
            if flush:
                self.flush(final=True)
        finally:
            for handle in self.handles:
                handle.remove()
            self.handles = []
            for entry in self.pending:  # left whole (the with block raised): drop our deepcopy hook
                param = entry.param()
                if param is not None and "__deepcopy__" in vars(param):
                    del param.__deepcopy__
                if param is not None:
                    _restore_class(param)
            self.pending = []

    def _on_parameter(self, module, name, param):
        if param is None or internal.active() or is_zero_param(param):
            return None
        modules = constructing_modules()
        ref = weakref.ref(param)
        self.pending.append(_Pending(ref, modules[0] if modules else None, weakref.ref(module), name))
        param.__deepcopy__ = functools.partial(self._deepcopy_pending, ref)  # replaced by ZeroParam's
        param.__class__ = pending_class(type(param))  # ds_* reads partition it (see the Note above)
        return None

    def _deepcopy_pending(self, ref, memo):
        """``copy.deepcopy`` of a parameter not partitioned yet: partition it first if its constructor
        has returned (nn.TransformerEncoder deep-copies the finished layer it is given), then copy."""
        param = ref()
        self.flush(final=False)
        owner = zero_param_of(param)
        if owner is not None:
            return owner.deepcopy(memo)
        copy = torch.nn.Parameter(param.data.clone(memory_format=torch.preserve_format), param.requires_grad)
        memo[id(param)] = copy
        return copy

    def _on_buffer(self, module, name, buffer):
        if buffer is not None and buffer.device != self.device:
            return buffer.to(self.device)
        return None

    def flush(self, final: bool) -> None:
        """Partition the pending parameters whose anchor's constructor has returned (all when final)."""
        if not self.pending or internal.active():
            return
        with internal.section():  # (the checks below are torch calls: the mode must not see them)
            ready = self._take_ready(final)
        if not ready:
            return
        with torch.profiler.record_function("zero_ext::init_partition"):
            converted = convert.partition_params([param for param, _ in ready], self.group, self.remote_device,
                                                 self.pin_memory)
        labels = {id(param): label for param, label in ready}
        for zp in converted:
            zp.rename(labels[id(zp.param)])
            zp.sanity_checks, zp.gather_by_all_reduce = self.sanity_checks, self.gather_by_all_reduce
            zp.recastable = self.dtype is None
            if self.nvme is not None:
                self.nvme.pieces().add_piece(("init", zp.ds_id), zp)

    def _take_ready(self, final: bool) -> List[Tuple[torch.nn.Parameter, str]]:
        """The pending parameters to partition now, each with a name for messages ("Linear.weight")."""
        alive = set() if final else {id(m) for m in constructing_modules()}
        ready, keep = [], []
        for entry in self.pending:
            param = entry.current()
            if param is None or is_zero_param(param):
                continue
            if param.is_meta:  # no values to cut yet (skip_init builds on the meta device, then to_empty)
                keep.append(entry)  # (still there at Init's exit: left as it is, like a with block that raised)
                continue
            if final or (entry.anchor is not None and id(entry.anchor) not in alive):
                _restore_class(param)
                old = entry.param()
                if old is not None and old is not param:  # (replaced in its module: see _Pending.current)
                    _restore_class(old)
                module = entry.module()
                ready.append((param, f"{type(module).__name__}.{entry.name}" if module is not None else entry.name))
            else:
                keep.append(entry)
        self.pending = keep
        return ready


# -- the public context ----------------------------------------------------------------------------

class Init(contextlib.ContextDecorator):
    """DeepSpeed's ``zero.Init``: a context manager (and decorator) under which each module's parameters
    are partitioned as soon as its constructor returns, with rank 0's values (so every rank gets the
    model rank 0 would have built, whatever each rank's seed).

    - ``module``: partition an already built model now (its values from rank 0).
    - ``data_parallel_group`` (or ``mpu.get_data_parallel_group()``): the group parameters are
      partitioned over; default: all ranks.
    - ``remote_device``: ``"cpu"`` keeps the pieces in host memory (``pin_memory`` pins them when CUDA
      is present); None keeps them on the local device. ``"nvme"`` (needs a config with
      ``offload_param.nvme_path``): each piece is written to a swap file as its module is built and its
      host memory released; ``initialize`` moves the trainable ones into the engine's sub-group files.
    - ``config_dict_or_path`` (``config``: deprecated spelling): a DeepSpeed config; its
      ``zero_optimization.offload_param`` decides ``remote_device``/``pin_memory``,
      and ``bf16``/``fp16`` the dtype (else float32); ``override_module_apply`` is accepted (writes
      after partitioning are exact without a Module.apply patch).
    - ``dtype``: cast new floating-point tensors to it (half, bfloat16 or float32). Without a config
      and a dtype, tensors keep torch's default dtype (DeepSpeed picks fp16 on accelerators), and
      ``initialize`` recasts those parameters to the training dtype of its config (so DeepSpeed's
      ``with zero.Init(): model = ...`` followed by an fp16 or bf16 config trains as written).
    - ``mem_efficient_linear``: accepted; zero_ext never keeps gathered weights alive for backward
      (see [Note: freeing gathered storage] in param.py), so there is nothing to switch.
    - ``zero_quantized_weights``, ``zero_quantized_nontrainable_weights``: accepted; whether the training
      gathers travel quantized (ZeRO++ qwZ) and frozen pieces are kept as int8 is the engine's config
      (``zero_optimization.zero_quantized_*``); Init's own gathers are exact.
    - ``enabled=False``: do nothing.

    Nested Init contexts share the outermost one's settings.
    """

    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device=None, pin_memory: bool = False,
                 config_dict_or_path=None, config=None, enabled: bool = True, dtype: Optional[torch.dtype] = None,
                 mpu=None, zero_param_parallel_group=None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group=None,
                 param_swapper=None):
        self.enabled = enabled
        if not enabled:
            return
        unsupported = {"zero_param_parallel_group": zero_param_parallel_group is not None,
                       "sequence_data_parallel_group": sequence_data_parallel_group is not None,
                       "param_swapper": param_swapper is not None}
        given = [k for k, v in unsupported.items() if v]
        if given:
            raise NotImplementedError(f"zero_ext zero.Init: {', '.join(given)} not implemented (ZeRO++ and "
                                      "NVMe swapping come later); leave them at their defaults")
        if config is not None:
            warnings.warn("zero.Init(config=...) is deprecated; use config_dict_or_path=...", DeprecationWarning,
                          stacklevel=2)
            config_dict_or_path = config_dict_or_path if config_dict_or_path is not None else config
        self.override_module_apply = True
        self.mem_efficient_linear = mem_efficient_linear
        self.nvme = None
        self.sanity_checks = self.gather_by_all_reduce = False
        if config_dict_or_path is not None:
            remote_device, pin_memory, dtype = self._read_config(config_dict_or_path, remote_device, pin_memory,
                                                                 dtype)
        if str(getattr(remote_device, "value", remote_device)) == "nvme" and self.nvme is None:
            raise ValueError("zero.Init(remote_device='nvme') needs the swap directory: pass config_dict_or_path "
                             "with zero_optimization.offload_param.nvme_path")
        if dtype is not None and dtype not in (torch.half, torch.bfloat16, torch.float32):
            raise ValueError(f"zero.Init: dtype must be torch.half, torch.bfloat16 or torch.float32, not {dtype}")
        self.dtype = dtype
        self.device = convert.local_device()
        convert.shard_device(remote_device, self.device)  # an unknown device fails here, not at the first module
        self.remote_device, self.pin_memory = remote_device, pin_memory
        if not dist.is_initialized():
            comm.init_distributed(verbose=False)
        self.group = convert.resolve_group(data_parallel_group, mpu)
        convert.check_single_rank_group(self.group)
        if module is not None:
            for zp in convert.partition_module(module, self.group, self.remote_device, self.pin_memory, self.device):
                zp.sanity_checks, zp.gather_by_all_reduce = self.sanity_checks, self.gather_by_all_reduce
                zp.recastable = self.dtype is None

    def _read_config(self, source, remote_device, pin_memory, dtype):
        cfg = load_config(source)
        zc = cfg.zero_optimization
        if zc.offload_param is not None and str(zc.offload_param.device) != "none":
            remote_device, pin_memory = str(zc.offload_param.device), zc.offload_param.pin_memory
        if str(getattr(remote_device, "value", remote_device)) == "nvme" and zc.offload_param is not None \
                and zc.offload_param.nvme_path:
            self.nvme = _InitSwap(zc.offload_param, cfg.aio)
        self.override_module_apply = zc.override_module_apply
        self.sanity_checks = zc.enable_sanity_checks
        self.gather_by_all_reduce = zc.use_all_reduce_for_fetch_params
        self.mem_efficient_linear = zc.memory_efficient_linear
        if dtype is None:
            dtype = torch.bfloat16 if cfg.bf16.enabled else torch.half if cfg.fp16.enabled else torch.float32
        return remote_device, pin_memory, dtype

    def __enter__(self):
        global _ACTIVE
        if not self.enabled:
            return self
        if _ACTIVE is not None:
            _ACTIVE.depth += 1
            return self
        session = _InitSession(self)
        session.open()
        _ACTIVE = session
        return self

    def __exit__(self, exc_type, exc, tb):
        global _ACTIVE
        if not self.enabled or _ACTIVE is None:
            return False
        if _ACTIVE.depth > 0:
            _ACTIVE.depth -= 1
            return False
        session, _ACTIVE = _ACTIVE, None
        session.close(flush=exc_type is None)
        return False


class MiCS_Init(Init):  # noqa: N801 (DeepSpeed's name)
    """``zero.Init`` partitioning over MiCS's shard groups (zero/mics.py): each parameter is cut
    ``zero_optimization.mics_shard_size`` ways inside this rank's shard group and replicated across the
    others (global rank 0's value everywhere). ``config_dict_or_path`` is required (it holds the shard size
    and mics_hierarchical_params_gather); the other arguments are zero.Init's. Give the engine the same
    config. ``data_parallel_group`` / ``mpu``: the shard groups are cut from the whole world, so a data-parallel
    group other than the world is refused."""

    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group=None,
                 sequence_data_parallel_group=None, mem_efficient_linear: bool = True, remote_device=None,
                 pin_memory: bool = False, config_dict_or_path=None, config=None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu=None):
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is None:
            raise ValueError("zero.MiCS_Init needs config_dict_or_path: the config with "
                             "zero_optimization.mics_shard_size")
        zc = load_config(source).zero_optimization
        if zc.mics_shard_size <= 0:
            raise ValueError(f"zero.MiCS_Init: the config's zero_optimization.mics_shard_size is {zc.mics_shard_size}; "
                             "set it to the ranks of one shard group (a divisor of the world size), or use zero.Init")
        super().__init__(None, None, mem_efficient_linear, remote_device, pin_memory, config_dict_or_path, config,
                         enabled, dtype, None, sequence_data_parallel_group=sequence_data_parallel_group)
        if not enabled:
            return
        given = convert.resolve_group(data_parallel_group, mpu)
        if given is not None and dist.get_world_size(given) != dist.get_world_size():
            raise NotImplementedError("zero.MiCS_Init: MiCS's shard groups are cut from the whole world; a "
                                      "data_parallel_group (or mpu) smaller than the world is not supported")
        self.mics = mics_groups(zc.mics_shard_size, zc.mics_hierarchical_params_gather)
        self.group = self.mics.shard_group
        if module is not None:
            convert.partition_module(module, self.group, self.remote_device, self.pin_memory, self.device)
