"""DeepSpeed's methods of a ZeRO-3 parameter: gathering by hand (``param.all_gather()``,
``param.all_gather_coalesced(params)`` and ``param.partition()``, with their handles), and
``param.convert_to_zero_parameters(params)``, which partitions parameters made after zero.Init (a LoRA
adapter attached to a partitioned model) the way this parameter was.

A parameter gathered this way is held by ``BY_HAND`` (a holder like a module call or a GatheredParameters
block, see param.py): it stays AVAILABLE through forwards and backwards that use it, until
``param.partition()`` drops that hold, as in DeepSpeed. Gathering is collective (every rank of the
parameters' group, the same parameters, in the same order), and checked like a GatheredParameters
block: one fetch-order agreement row per bucket, so ranks that gather different parameters fail with
FetchOrderError instead of mixing their bytes.
"""
from typing import List, Optional, Sequence

import torch

from .fetch import FetchSite, issue, release, wait_gathered
from .status import FetchKind


class _ByHand:
    def __repr__(self) -> str:
        return "param.all_gather()"


BY_HAND = _ByHand()  # the holder of the parameters gathered by hand until param.partition()


class AllGatherCoalescedHandle:
    """What ``all_gather_coalesced`` returns: ``wait()`` makes its parameters AVAILABLE."""

    def __init__(self, params: Sequence):
        self.params = list(params)

    def wait(self, handle_dependency: bool = True) -> None:  # (DeepSpeed's keyword, nothing to order here)
        wait_gathered(self.params)


class MultipleAllGatherHandles:
    """Several handles waited as one; ``handle_dependency`` is passed on to each by keyword."""

    def __init__(self, handles: Sequence):
        self.handles = list(handles)

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


def _zero_params(params) -> List:
    from .param import zero_param_of  # (param.py attaches these methods: imported at call time)

    found = {}
    for p in params:
        zp = zero_param_of(p)
        if zp is None:
            raise TypeError(f"{type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))} is not a ZeRO-3 "
                            f"parameter (made by zero.Init or a stage 3 engine)")
        found[id(zp)] = zp
    return sorted(found.values(), key=lambda zp: zp.ds_id)


def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False) -> AllGatherCoalescedHandle:
    """Start gathering ``params`` (collective); they stay gathered until ``partition()``. ``safe_mode``
    (DeepSpeed's extra checks) is what the agreement row always does here; ``quantize`` is refused: qwZ
    gathers are the engine's own."""
    if quantize:
        raise NotImplementedError("param.all_gather_coalesced(quantize=True): quantized gathers are the "
                                  "engine's own (zero_quantized_weights); gather by hand without quantize")
    zps = _zero_params(params)
    for zp in zps:
        zp.hold(BY_HAND)
    issue(zps, FetchSite(FetchKind.GATHERED), check=True)
    return AllGatherCoalescedHandle(zps)


def all_gather(owner, param_list: Optional[Sequence] = None, async_op: bool = False, hierarchy: int = 0):
    """``param.all_gather(param_list=None, async_op=False)``: this parameter, or ``param_list``,
    gathered; a handle with ``async_op``, else None once they are AVAILABLE."""
    handle = all_gather_coalesced(param_list if param_list is not None else [owner.param])
    if async_op:
        return handle
    handle.wait()
    return None


@torch.no_grad()
def partition(owner, param_list: Optional[Sequence] = None, has_been_updated: bool = False,
              free_data: bool = True) -> None:
    """``param.partition(param_list=None, has_been_updated=False)``: drop the by-hand hold; each parameter
    no one else holds is partitioned again (local). ``has_been_updated``: the full value was changed on
    this rank, and this rank's part of it becomes the piece (the update hooks run: the engine's fp32
    master follows), as with DeepSpeed, where every rank is expected to have made the same change."""
    zps = _zero_params(param_list if param_list is not None else [owner.param])
    wait_gathered(zps)
    if has_been_updated:
        for zp in zps:
            zp.write_back()  # (a replaced param.data included)
    release(zps, BY_HAND)


def convert_to_zero_parameters(owner, param_list: Sequence) -> None:
    """``param.convert_to_zero_parameters(param_list)``: partition the parameters of ``param_list`` that
    are not ZeRO-3 parameters yet like ``owner`` (its group, compute device, where its piece lives,
    its gather options); each keeps its own dtype, so an fp32 adapter stays fp32 next to a bf16 base.
    Collective over owner's group: every rank converts the same parameters in the same order, and rank
    0's values win (DeepSpeed broadcasts them too)."""
    from . import convert  # (convert.py imports param.py, which attaches this method)

    home = "cpu" if owner.piece_io is not None else owner.shard.device
    remote = None if home == owner.compute_device else str(home)
    converted = convert.partition_params(list(param_list), owner.group, remote,
                                         pin_memory=owner.shard.is_pinned(), compute=owner.compute_device)
    for zp in converted:
        zp.sanity_checks, zp.gather_by_all_reduce = owner.sanity_checks, owner.gather_by_all_reduce
        if owner.piece_io is not None:  # zero.Init put its pieces in swap files: these go there too
            owner.piece_io.add_piece(("init", zp.ds_id), zp)
