"""Under zero.Init, a torch call that reaches a partitioned parameter sees its full value.

[Note: exact initialisation under zero.Init]
zero.Init partitions a module's parameters as soon as its constructor returns (init.py), but code
keeps initialising them afterwards: a parent's constructor (``nn.init.xavier_uniform_(self.fc.weight)``,
``self.apply(init_fn)``), transformers' ``post_init`` (its own recursion over the finished modules,
``init.normal_(module.weight)``, ``init.zeros_(module.weight[padding_idx])``), user code in the ``with``
block. On an empty tensor all of that silently does nothing (DeepSpeed's zero.Init has the same hole).
So Init's construction mode, which sees every torch call, treats a call with a partitioned parameter
among its arguments in one of three ways:

- calls about metadata that does not depend on the value -- ``dtype``, ``device``, ``requires_grad``,
  ``grad``, ``requires_grad_``, hooks -- run on the parameter as it is;
- calls about the shape only -- ``dim()``, ``size()``, ``shape``, ``numel()``, ``stride()`` -- are
  answered for the full shape from a meta tensor of it, without communication (``nn.init`` computes
  fans this way before it draws);
- every other call *materialises* the parameter first: it is gathered (held by this Materialiser, so
  it stays gathered) and the call runs on the full value, as in the plain constructor. Views taken of it
  (``p.data``, ``p[i]``, ``p.view(...)``) are views of the full storage, so writes through them land.

A materialised parameter is partitioned again at the first later torch call that does not reach it,
once no tensor other than its own views it (the storage's reference count is back to what it was
when gathered), and at Init's exit: rank 0's full value is broadcast and every rank keeps its piece of
it (GatheredParameters with ``modifier_rank=0``), so every rank holds what rank 0's plain constructor
would have built. At most the parameters of the current call (and those still viewed) are whole at
once, which keeps zero.Init's memory bound.

Why this is exact: the values and the random numbers drawn depend only on the sequence of torch calls
and their (full) arguments, and that sequence is the plain constructor's -- Init adds gathers,
broadcasts and scatters, which draw nothing. So ``with zero.Init(): build()`` under a seed is
bit-identical to ``build()`` under that seed on rank 0, and every rank's generator advances as the
plain construction's would. Gathers and broadcasts are collective: every rank runs the same
construction (a divergent one raises FetchOrderError, [Note: fetch-order agreement]).
"""
from typing import Dict, List, Sequence, Tuple

import torch

from . import collectives, internal
from .external import tensor_args
from .fetch import FetchSite, check_agreement, fetch, release
from .gathered import adopt_values_of
from .param import ZeroParam
from .status import FetchKind, ZeroParamStatus

# attributes read or set as they are (they do not depend on the value) ...
_PASS_ATTRIBUTES = frozenset([
    "dtype", "device", "requires_grad", "grad", "grad_fn", "is_leaf", "layout", "is_cuda", "is_cpu", "is_meta",
    "is_sparse", "is_sparse_csr", "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps", "names",
    "_version", "output_nr", "_base", "retains_grad", "itemsize", "name", "_grad", "_grad_fn",
    "_backward_hooks", "_post_accumulate_grad_hooks"])
_PASS_METHODS = frozenset(["requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "get_device",
                           "type", "is_pinned", "is_shared"])
# ... and those answered for the full shape
_SHAPE_ATTRIBUTES = frozenset(["shape", "ndim", "nbytes"])
_SHAPE_METHODS = frozenset(["dim", "ndimension", "size", "numel", "nelement", "element_size", "stride",
                            "is_contiguous", "is_floating_point", "is_complex", "is_signed", "__len__"])
_DESCRIPTOR_CALLS = ("__get__", "__set__", "__delete__")


def _kind(func) -> str:
    """'pass', 'shape' or 'full' (see [Note: exact initialisation under zero.Init])."""
    name = getattr(func, "__name__", "")
    if name in _DESCRIPTOR_CALLS:
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        if attribute in _PASS_ATTRIBUTES:
            return "pass"
        return "shape" if attribute in _SHAPE_ATTRIBUTES and name == "__get__" else "full"
    if name in _PASS_METHODS:
        return "pass"
    return "shape" if name in _SHAPE_METHODS else "full"


def _storage_refs(zp: ZeroParam) -> int:
    return torch._C._storage_Use_Count(zp.full.untyped_storage()._cdata)


class Materialiser:
    """The parameters zero.Init gathered for the calls that reached them, until they are partitioned
    again (see [Note: exact initialisation under zero.Init])."""

    NOT_REACHED = object()  # call()'s answer when no ZeRO-3 parameter is among the arguments

    def __init__(self):
        self.held: Dict[int, Tuple[ZeroParam, int]] = {}  # id -> (parameter, storage references when gathered)

    def __repr__(self) -> str:
        return "zero.Init (a torch call on the full parameter)"

    def call(self, func, args, kwargs):
        """Run ``func`` as the plain constructor would; returns NOT_REACHED when no ZeRO-3 parameter is
        among its arguments (the caller runs it)."""
        reached: Dict[int, ZeroParam] = {}
        for t in tensor_args(args, kwargs):
            zp = getattr(t, "_zero_owner", None)
            if zp is not None and (zp.status is not ZeroParamStatus.AVAILABLE or id(zp) in self.held):
                reached[id(zp)] = zp
        if self.held:
            self.settle(reached)
        if not reached:
            return self.NOT_REACHED
        kind = _kind(func)
        if kind == "pass":
            return func(*args, **kwargs)
        first = getattr(args[0], "_zero_owner", None) if args else None
        if kind == "shape" and first is not None and first.status is not ZeroParamStatus.AVAILABLE:
            stand_in = torch.empty(first.shape, dtype=first.dtype, device="meta")
            return func(stand_in, *args[1:], **kwargs)
        self._materialise([zp for zp in reached.values() if id(zp) not in self.held])
        return func(*args, **kwargs)

    def _materialise(self, params: List[ZeroParam]) -> None:
        if not params:
            return
        fetch(params, self, FetchSite(FetchKind.INIT))
        for zp in params:
            zp.expect_views()
            self.held[id(zp)] = (zp, _storage_refs(zp))

    def settle(self, reached: Dict[int, ZeroParam]) -> None:
        """Partition again the held parameters this call does not reach and nothing else views."""
        done = [zp for key, (zp, refs) in self.held.items() if key not in reached and _storage_refs(zp) <= refs]
        if done:
            self._partition(done, keep_rank=0)

    def finish(self, ok: bool) -> None:
        """Init's exit: partition everything still held; rank 0's values when ``ok``, else (the with
        block raised, perhaps on one rank only) each rank's own, without communication."""
        params = [zp for zp, _ in self.held.values()]
        if params:
            self._partition(params, keep_rank=0 if ok else None)

    def _partition(self, params: Sequence[ZeroParam], keep_rank) -> None:
        for zp in params:
            del self.held[id(zp)]
        gathered = [zp for zp in params if zp.status is ZeroParamStatus.AVAILABLE]
        with internal.section():
            if keep_rank is not None and gathered and collectives.rank_and_world(gathered[0].group)[1] > 1:
                # the broadcasts must match across ranks: agree on what is partitioned first
                check_agreement(FetchSite(FetchKind.INIT), [zp.shape for zp in gathered], gathered[0].ds_id,
                                gathered[0].group, collectives.check_device(gathered[0].group,
                                                                            gathered[0].compute_device))
            if keep_rank is not None:
                adopt_values_of(keep_rank, gathered)
            else:
                with torch.no_grad():
                    for zp in gathered:
                        zp.write_back()
            release(list(params), self)
