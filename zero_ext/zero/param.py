"""ZeroParam: the one owner of a partitioned parameter's state.

A ZeRO-3 parameter is the user's own ``torch.nn.Parameter`` object (its identity never changes: the
user's references, ``named_parameters()`` and optimizer param groups stay valid). What changes is its
``.data``: the full tensor while gathered, an empty tensor (shape ``[0]``) while partitioned. Everything
else about it -- its piece of the value, its status, who is using it -- lives in one ZeroParam.

[Note: the ds_* facade]
DeepSpeed's attributes (``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_tensor``, ``ds_status``,
``ds_persist``, ``ds_process_group``) are set on the Parameter because third-party code (HF
Transformers, Accelerate, PEFT) reads them. They are a read-only front: ZeroParam writes them in
``_publish()`` after each of its own transitions, and no other code in zero_ext writes them. Internal
code never reads them either; it goes through the owner, ``zero_param_of(param)``. Each transition
first checks that the front still says what the owner last wrote, so a foreign write is reported
instead of silently desynchronising the two. Two more attributes complete the front: the owner's
back-pointer ``_zero_owner``, and ``__deepcopy__`` (``copy.deepcopy`` looks it up on the instance;
Parameter's own would copy the empty data, ours copies the piece).

[Note: freeing gathered storage]
The full value lives in ``_padded``, a flat tensor of ``world * shard_numel`` elements on the compute
device owned by this ZeroParam; ``_full`` is a view of its first ``ds_numel`` elements in ``ds_shape``.
Gathering makes ``param.data`` that view; partitioning sets ``param.data`` to an empty tensor *and*
resizes ``_padded``'s storage to zero bytes. The second step matters: autograd saves views of weights
(``F.linear`` saves ``weight.t()``), and those views would otherwise keep every gathered weight alive
from forward until backward -- the reason DeepSpeed replaces ``F.linear`` (its "memory efficient
linear"). Freeing the storage itself releases the memory while the views stay objects; the
pre-backward hook re-gathers into the same storage before any of them is read (FSDP2 does the same:
its ``[Note: FSDP and autograd]``). Reading such a view while the storage is freed reads freed memory
(it can segfault), so only views zero_ext knows will be refilled may outlive a resize: those of the
module hooks. Where user code may keep a view -- ``t = p.detach().cpu()`` (on the CPU, the same
storage) or ``p.detach().numpy()`` inside GatheredParameters or zero.Init, which call
``expect_views()`` -- partitioning drops its references to the storage instead of resizing it: the
views keep it and the gathered values (or, with none left, it is freed at once), and the next gather
allocates anew; so does storage torch cannot resize (a numpy array of it). The
all-gather writes straight into ``_padded`` (one parameter) or is copied out into it (several, see
collectives.py), so there is one allocation per gather and nothing to trim.
"""
import contextlib
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional

import torch
from torch.utils.hooks import RemovableHandle

from .._native import planner
from .guard import guarded_class
from .status import ZeroParamStatus

#: ds_id of the next parameter converted in this process (DeepSpeed numbers parameters in construction
#: order, process-wide; the numbering is identical on every rank when every rank builds the same model).
_next_ds_id = 0
#: ds_id -> ZeroParam, for naming a parameter another rank mentions (error messages only).
_BY_DS_ID: "weakref.WeakValueDictionary[int, ZeroParam]" = weakref.WeakValueDictionary()



def next_ds_id() -> int:
    """Take the next ds_id."""
    global _next_ds_id
    _next_ds_id += 1
    return _next_ds_id - 1


def peek_ds_id() -> int:
    """The ds_id the next converted parameter will get."""
    return _next_ds_id


def align_ds_ids(first: int) -> None:
    """Continue numbering at ``first`` if it is ahead: a partitioning makes every rank agree on the
    largest next ds_id first, so the same parameter has the same ds_id on every rank even after one rank
    converted parameters alone (a rank-0-only tool), and a fetch-order message can name another rank's
    parameters by their ds_id."""
    global _next_ds_id
    _next_ds_id = max(_next_ds_id, first)


def is_zero_param(obj: Any) -> bool:
    """True for a tensor partitioned by ZeRO-3 (DeepSpeed's test: a tensor with a ``ds_id``). Read from the
    instance: asking about a parameter zero.Init has pending must not partition it (init.py, pending_class)."""
    return isinstance(obj, torch.Tensor) and "ds_id" in getattr(obj, "__dict__", ())


def zero_param_of(param: torch.Tensor) -> Optional["ZeroParam"]:
    """The owner of a ZeRO-3 parameter, or None for any other tensor."""
    return getattr(param, "_zero_owner", None)


def zero_param_by_ds_id(ds_id: int) -> Optional["ZeroParam"]:
    return _BY_DS_ID.get(ds_id)


class ActiveSubModules:
    """DeepSpeed's ``param.ds_active_sub_modules``: the indices of the module calls holding the parameter
    gathered -- a live view of its holders (libraries read it, and TRL clears it after removing the hooks:
    ``clear()`` forgets the module calls' holds and nothing else)."""

    __slots__ = ("_owner",)

    def __init__(self, owner: "ZeroParam"):
        self._owner = owner

    def _calls(self):
        return [h for h in self._owner._holders if isinstance(getattr(h, "module_index", None), int)]

    def __iter__(self):
        return iter([h.module_index for h in self._calls()])

    def __len__(self) -> int:
        return len(self._calls())

    def __contains__(self, index) -> bool:
        return any(h.module_index == index for h in self._calls())

    def __bool__(self) -> bool:
        return bool(self._calls())

    def clear(self) -> None:
        for h in self._calls():
            self._owner.unhold(h)

    def __repr__(self) -> str:
        return "{" + ", ".join(str(i) for i in self) + "}"


class ZeroParam:
    """One parameter's pieces, full storage, status and users.

    Created from a parameter whose full value is still in ``param.data`` and from this rank's piece of
    it (``shard``: ``shard_numel`` elements, padding zeroed), which the caller has already cut (see
    convert.py): the constructor publishes the facade and leaves the parameter partitioned.

    Holders: whoever needs the full value (a module call, a GatheredParameters context, persistence)
    ``hold()``s it, and it may only be partitioned when nobody holds it (DeepSpeed's
    ``ds_active_sub_modules``). The holders are kept here, with the status they protect.
    """

    def __init__(self, param: torch.nn.Parameter, ds_id: int, group, rank: int, world: int,
                 shard: torch.Tensor, compute_device: torch.device, shape: Optional[torch.Size] = None):
        if zero_param_of(param) is not None:
            raise RuntimeError(f"parameter ds_id={param.ds_id} is already partitioned by ZeRO-3")
        self.param = param
        self.ds_id = ds_id
        self.shape = torch.Size(param.shape if shape is None else shape)
        self.numel = self.shape.numel()
        self.dtype = param.dtype
        self.group, self.rank, self.world = group, rank, world
        self.shard_numel = planner.shard_numel(self.numel, world)
        if shard.shape != (self.shard_numel,):
            raise ValueError(f"shard of {tuple(shard.shape)} for a parameter of {self.numel} elements in "
                             f"{world} pieces; expected ({self.shard_numel},)")
        self.shard = shard
        self.compute_device = torch.device(compute_device)
        self.status = ZeroParamStatus.AVAILABLE  # the parameter still holds its full value
        self.persist = False
        self.name = f"ds_id={ds_id}"  # replaced by the parameter's qualified name once a model is known
        self._padded: Optional[torch.Tensor] = None
        self._full: Optional[torch.Tensor] = None
        self._holders: Dict[Any, None] = {}  # an ordered set
        self.meter = None  # the GatherMeter of the ZeroModel this parameter belongs to (meter.py)
        self.gathers = 0  # how many times the parameter was gathered (diagnostics and tests)
        self.pending_gather = None  # while INFLIGHT: the collective filling the storage (fetch.py waits on it)
        self._update_hooks: Dict[int, Callable[["ZeroParam"], None]] = OrderedDict()
        self.piece_io = None  # offload_param nvme: the piece lives in a swap file (nvme/pieces.py, NVMePieces)
        self.quantized_gathers = False  # ZeRO++ qwZ: forward/backward gathers travel as int8 (fetch.py)
        self.sanity_checks = False  # zero_optimization.enable_sanity_checks: read-only blocks are checked (gathered.py)
        self.gather_by_all_reduce = False  # stage3_use_all_reduce_for_fetch_params (collectives.py)
        self.secondary = None  # ZeRO++ hpZ: the SecondaryPartition of its ZeroModel (secondary.py), or None
        self.plain_class = type(param)  # while gathered; guarded_class while partitioned (guard.py)
        self.guarded_class = guarded_class(self.plain_class)
        self._views_possible = False  # see [Note: freeing gathered storage]
        # built under a zero.Init that named no dtype (no dtype argument, no config): initialize may recast it
        self.recastable = False
        shard.ds_numel = self.shard_numel  # DeepSpeed's attribute on ds_tensor
        param._zero_owner = self
        param.ds_active_sub_modules = ActiveSubModules(self)
        param.ds_summary = self.summary  # DeepSpeed's param.ds_summary(), for assertion messages and bug reports
        # DeepSpeed's gathering by hand (ds_param_methods.py)
        param.all_gather, param.partition = self.ds_all_gather, self.ds_partition
        param.all_gather_coalesced = self.ds_all_gather_coalesced
        param.convert_to_zero_parameters = self.ds_convert_to_zero_parameters
        param.__deepcopy__ = self.deepcopy  # Parameter's own would copy the empty data
        _BY_DS_ID[ds_id] = self
        self._publish()
        self._partition_data()

    # -- the facade --------------------------------------------------------------------------------------

    def _publish(self) -> None:
        """Write the ds_* front (see [Note: the ds_* facade]); the only writer."""
        p = self.param
        p.ds_id, p.ds_shape, p.ds_numel = self.ds_id, self.shape, self.numel
        p.ds_tensor, p.ds_status, p.ds_persist = self.shard, self.status, self.persist
        p.ds_process_group = self.group

    def _check_facade(self) -> None:
        p = self.param
        if p.ds_status is not self.status or p.ds_tensor is not self.shard or p.ds_persist is not self.persist:
            raise RuntimeError(
                f"ZeRO-3 parameter {self.name}: its ds_status/ds_tensor/ds_persist attributes were changed "
                "by code outside zero_ext. They are read-only: gather with zero_ext.zero.GatheredParameters, "
                "and change the piece through the engine's safe_set_* functions.")

    def _assert_status(self, *allowed: ZeroParamStatus) -> None:
        if self.status not in allowed:
            names = " or ".join(s.name for s in allowed)
            raise RuntimeError(f"ZeRO-3 parameter {self.name} is {self.status.name}, expected {names} "
                               f"(holders: {self.describe_holders()})")

    # -- transitions -------------------------------------------------------------------------------------

    def to_inflight(self) -> torch.Tensor:
        """NOT_AVAILABLE -> INFLIGHT: allocates the full storage and returns the flat padded buffer
        (``world * shard_numel`` elements) for the all-gather to fill."""
        self._check_facade()
        self._assert_status(ZeroParamStatus.NOT_AVAILABLE)
        nbytes = self.world * self.shard_numel * self.dtype.itemsize
        if self._padded is None:
            self._padded = torch.empty(self.world * self.shard_numel, dtype=self.dtype, device=self.compute_device)
            self._full = self._padded[: self.numel].view(self.shape)
        elif self._padded.untyped_storage().nbytes() != nbytes:
            self._padded.untyped_storage().resize_(nbytes)
        self.status = ZeroParamStatus.INFLIGHT
        self.gathers += 1
        if self.meter is not None and not self.persist:
            self.meter.add(self.numel)
        self._publish()
        return self._padded

    def to_gathered(self) -> None:
        """INFLIGHT -> AVAILABLE: the buffer holds every rank's piece; ``param.data`` becomes the full
        view."""
        self._check_facade()
        self._assert_status(ZeroParamStatus.INFLIGHT)
        self.param.__class__ = self.plain_class
        self.param.data = self._full
        self.status = ZeroParamStatus.AVAILABLE
        self.pending_gather = None
        self._publish()

    def to_partitioned(self) -> None:
        """AVAILABLE -> NOT_AVAILABLE: drops the full value (without writing it back to the piece; see
        ``write_back``). Refused while someone holds the parameter."""
        self._check_facade()
        self._assert_status(ZeroParamStatus.AVAILABLE)
        if self._holders:
            raise RuntimeError(f"ZeRO-3 parameter {self.name} cannot be partitioned: still in use by "
                               f"{self.describe_holders()}")
        self._partition_data()

    def expect_views(self) -> None:
        """Code outside zero_ext may keep views of the gathered value (GatheredParameters, zero.Init):
        the next partitioning leaves the storage to them instead of freeing it under them."""
        self._views_possible = True

    def _partition_data(self) -> None:
        if self.meter is not None and not self.persist and self.status is not ZeroParamStatus.NOT_AVAILABLE:
            self.meter.sub(self.numel)
        self.param.data = torch.empty(0, dtype=self.dtype, device=self.compute_device)
        self.param.__class__ = self.guarded_class
        if self._padded is not None:
            self._free_storage()
        self._views_possible = False
        self.status = ZeroParamStatus.NOT_AVAILABLE
        self._publish()

    def _free_storage(self) -> None:
        """Free the gathered storage, or leave it to the tensors still viewing it (see [Note: freeing
        gathered storage])."""
        storage = self._padded.untyped_storage()
        if storage.resizable() and not self._views_possible:
            storage.resize_(0)
        else:  # maybe viewed, or memory torch cannot resize (a numpy array of it, p.detach().numpy())
            self._padded = self._full = None  # views keep the values, or it is freed; the next gather allocates

    def await_gather(self, gather) -> None:
        """INFLIGHT: ``gather`` (fetch.py) is the collective filling the storage; to_gathered ends it."""
        self._assert_status(ZeroParamStatus.INFLIGHT)
        self.pending_gather = gather

    # -- where it belongs --------------------------------------------------------------------------------

    def attach_meter(self, meter) -> None:
        """The GatherMeter of the ZeroModel this parameter now belongs to (None: it left it)."""
        self.meter = meter

    def quantize_gathers(self, on: bool) -> None:
        """ZeRO++ qwZ: whether the forward and backward gathers of this parameter travel quantized (set by
        the ZeroModel it belongs to; see [Note: quantized all-gather] in quantized_gather.py)."""
        self.quantized_gathers = bool(on)

    def attach_secondary(self, secondary) -> None:
        """ZeRO++ hpZ: the SecondaryPartition keeping this parameter's node-local copy (None: off)."""
        self.secondary = secondary

    def rename(self, name: str) -> None:
        """The parameter's qualified name in its model (for messages)."""
        self.name = name

    def place_piece(self, piece_io) -> None:
        """Where the piece lives: an NVMePieces store (nvme/pieces.py), or None for this ZeroParam's own
        ``shard``."""
        self.piece_io = piece_io

    def recast(self, dtype: torch.dtype) -> None:
        """The piece in another floating-point dtype (``initialize``, for a parameter built under a zero.Init
        that named none: DeepSpeed's Init would have made it fp16, zero_ext's kept torch's default). Only
        while partitioned and held by no one, its piece in memory."""
        self._assert_status(ZeroParamStatus.NOT_AVAILABLE)
        if self._holders or self.piece_io is not None or self.secondary is not None:
            raise RuntimeError(f"ZeRO-3 parameter {self.name} cannot change dtype now (held, or its piece is "
                               "on NVMe or copied): recast it before training starts")
        pinned = self.shard.device.type == "cpu" and self.shard.is_pinned()
        shard = self.shard.to(dtype)
        self.shard = shard.pin_memory() if pinned else shard
        self.shard.ds_numel = self.shard_numel
        self.dtype = dtype
        self._padded = self._full = None  # (a gathered buffer of the old dtype: the next gather allocates)
        self.param.__class__ = self.plain_class  # (the placeholder's dtype is what the model reports)
        self.param.data = torch.empty(0, dtype=dtype, device=self.compute_device)
        self.param.__class__ = self.guarded_class
        self._publish()  # (ds_tensor is the new piece)

    # -- the piece ---------------------------------------------------------------------------------------

    def read_piece(self) -> torch.Tensor:
        """The piece's values, for a gather (a copy when the piece lives on NVMe)."""
        return self.shard if self.piece_io is None else self.piece_io.read(self)

    def piece_in_memory(self, modified: bool = True):
        """Context: the piece in memory for the block (a no-op unless it lives on NVMe)."""
        return contextlib.nullcontext() if self.piece_io is None else self.piece_io.resident(self, modified)

    def write_back(self) -> None:
        """Copy this rank's part of the (gathered, possibly modified) full value into the piece, with the
        padding zeroed, then tell the update hooks. The full value is ``param.data``: if code replaced it
        (``param.data = t``) rather than writing into it, ``t`` is copied into the full storage first."""
        self._check_facade()
        self._assert_status(ZeroParamStatus.AVAILABLE)
        self.adopt_replaced_data()
        flat = self._full.reshape(-1)
        start = self.rank * self.shard_numel
        valid = planner.shard_valid(self.numel, self.world, self.rank)
        with self.piece_in_memory(), torch.no_grad():
            self.shard[:valid].copy_(flat[start: start + valid])
            self.shard[valid:].zero_()
            for hook in list(self._update_hooks.values()):
                hook(self)

    def adopt_replaced_data(self) -> None:
        """If ``param.data`` was replaced while gathered, copy the new value into the full storage and
        point ``param.data`` back at it (the shape must not change)."""
        data = self.param.data
        if data.data_ptr() == self._full.data_ptr() and data.shape == self.shape:
            return
        if data.shape != self.shape:
            raise RuntimeError(f"ZeRO-3 parameter {self.name}: param.data was replaced by a tensor of shape "
                               f"{tuple(data.shape)}; a partitioned parameter keeps its shape {tuple(self.shape)}")
        with torch.no_grad():
            self._full.copy_(data)
        self.param.data = self._full

    @property
    def full(self) -> torch.Tensor:
        """The full value (AVAILABLE only): a view of the gathered storage in ``ds_shape``."""
        self._assert_status(ZeroParamStatus.AVAILABLE)
        return self._full

    def replace_shard(self, new_shard: torch.Tensor) -> None:
        """Move the piece into ``new_shard`` (e.g. a view into the engine's contiguous buffer of all
        pieces, DeepSpeed's "defragmentation"); the current values are copied into it."""
        if new_shard.shape != (self.shard_numel,):
            raise ValueError(f"{self.name}: new piece has shape {tuple(new_shard.shape)}, expected "
                             f"({self.shard_numel},)")
        self._check_facade()
        with torch.no_grad():
            new_shard.copy_(self.read_piece())
        if self.piece_io is not None:  # (a piece zero.Init put on NVMe: it now lives in new_shard)
            self.piece_io.forget(self)
        new_shard.ds_numel = self.shard_numel
        self.shard = new_shard
        self._publish()

    def retire(self, value: torch.Tensor) -> None:
        """Turn the parameter back into a plain one holding ``value`` (its full value, ``ds_shape``): the
        ds_* front, the owner back-pointer and the gathered storage go (zero.unpartition)."""
        if self._holders:
            raise RuntimeError(f"ZeRO-3 parameter {self.name} cannot be made whole while in use by "
                               f"{self.describe_holders()}")
        p = self.param
        p.__class__ = self.plain_class
        p.data = value.reshape(self.shape)
        if self._padded is not None:
            self._free_storage()
        for name in ("ds_id", "ds_shape", "ds_numel", "ds_tensor", "ds_status", "ds_persist", "ds_process_group",
                     "_zero_owner", "__deepcopy__", "ds_active_sub_modules", "ds_summary", "all_gather", "partition",
                     "all_gather_coalesced"):
            p.__dict__.pop(name, None)
        _BY_DS_ID.pop(self.ds_id, None)
        self.status = ZeroParamStatus.NOT_AVAILABLE

    def register_update_hook(self, hook: Callable[["ZeroParam"], None]) -> RemovableHandle:
        """``hook(zero_param)`` runs after the piece was overwritten from a modified full value
        (GatheredParameters with a ``modifier_rank``, a write under zero.Init): the place where the
        engine's fp32 master copy of the piece follows."""
        handle = RemovableHandle(self._update_hooks)
        self._update_hooks[handle.id] = hook
        return handle

    # -- holders and persistence -------------------------------------------------------------------------

    def hold(self, holder: Any) -> None:
        self._holders[holder] = None

    def unhold(self, holder: Any) -> bool:
        """Forget ``holder``; True when nobody holds the parameter any more."""
        self._holders.pop(holder, None)
        return not self._holders

    def held_by(self, holder: Any) -> bool:
        return holder in self._holders

    def held_only_by(self, holder: Any) -> bool:
        return len(self._holders) == 1 and holder in self._holders

    @property
    def holders(self):
        return tuple(self._holders)

    def describe_holders(self) -> str:
        return ", ".join(str(h) for h in self._holders) or "nobody"

    def set_persistent(self, persist: bool) -> None:
        """Persistent parameters stay gathered on every rank (under the persistence thresholds); the
        flag is what ``ds_persist`` shows."""
        self._check_facade()
        if self.meter is not None and persist != self.persist and self.status is not ZeroParamStatus.NOT_AVAILABLE:
            self.meter.adjust(-self.numel if persist else self.numel)  # the meter counts non-persistent ones
        self.persist = persist
        self._publish()

    def deepcopy(self, memo: dict) -> torch.nn.Parameter:
        """``copy.deepcopy`` of the parameter (e.g. nn.TransformerEncoder cloning its layer under
        zero.Init): a new partitioned parameter with a copy of this rank's piece. No communication."""
        if id(self.param) in memo:
            return memo[id(self.param)]
        copy = torch.nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.compute_device),
                                  requires_grad=self.param.requires_grad)
        memo[id(self.param)] = copy
        owner = ZeroParam(copy, next_ds_id(), self.group, self.rank, self.world, self.read_piece().clone(),
                          self.compute_device, self.shape)
        owner.name = self.name
        return copy

    def ds_all_gather(self, param_list=None, async_op: bool = False, hierarchy: int = 0):
        from . import ds_param_methods  # (it imports fetch.py, which imports this module)
        return ds_param_methods.all_gather(self, param_list, async_op, hierarchy)

    def ds_all_gather_coalesced(self, params, safe_mode: bool = False, quantize: bool = False):
        from . import ds_param_methods
        return ds_param_methods.all_gather_coalesced(params, safe_mode, quantize)

    def ds_partition(self, param_list=None, has_been_updated: bool = False, free_data: bool = True) -> None:
        from . import ds_param_methods
        ds_param_methods.partition(self, param_list, has_been_updated, free_data)

    def ds_convert_to_zero_parameters(self, param_list) -> None:
        from . import ds_param_methods
        ds_param_methods.convert_to_zero_parameters(self, param_list)

    def summary(self) -> dict:
        """DeepSpeed's ``ds_summary()`` fields, for bug reports."""
        return {"id": self.ds_id, "name": self.name, "status": self.status.name, "numel": self.param.numel(),
                "ds_numel": self.numel, "shape": tuple(self.param.shape), "ds_shape": tuple(self.shape),
                "requires_grad": self.param.requires_grad,
                "grad_shape": None if self.param.grad is None else tuple(self.param.grad.shape),
                "persist": self.persist, "holders": self.describe_holders(),
                "ds_tensor.shape": tuple(self.shard.shape)}

    def __repr__(self) -> str:
        return f"ZeroParam({self.name}, ds_id={self.ds_id}, shape={tuple(self.shape)}, {self.status.name})"
