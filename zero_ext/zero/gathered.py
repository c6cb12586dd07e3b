"""GatheredParameters: the full values of some ZeRO-3 parameters, inside a ``with`` block.

    with GatheredParameters(model.embed.weight, modifier_rank=0):
        if rank == 0:
            model.embed.weight.normal_()     # rank 0's change is kept, on every rank
    with GatheredParameters(model.parameters()):
        print(model.head.weight.sum())       # read-only: changes are discarded

Collective: every rank of the parameters' groups must enter and leave together, with the same
parameters and modifier_rank (checked at entry: FetchOrderError on every rank otherwise).
"""
from typing import Iterable, List, Optional, Sequence, Union

import torch

from . import collectives, internal, mics
from .external import register_external_parameter
from .fetch import FetchSite, check_agreement, fetch, release
from .param import ZeroParam, zero_param_of
from .status import FetchKind


def adopt_values_of(group_rank: int, params: Sequence[ZeroParam]) -> None:
    """Each gathered parameter's full value becomes its value on ``group_rank`` (a replaced
    ``param.data`` included), every rank keeps its part as its piece and the update hooks run.
    Collective. A MiCS shard group's parameters take the value of global rank ``group_rank`` over the
    whole world (DeepSpeed's data-parallel group there), so that the replicas stay equal."""
    with internal.section(), torch.no_grad():
        for zp in params:
            zp.adopt_replaced_data()
            group = None if mics.of(zp.group) is not None else zp.group
            collectives.broadcast(zp.full, group_rank, group)
            zp.write_back()


class GatheredParameters:
    """Gather ``params`` (a tensor or an iterable of tensors) on enter; partition them again on exit.

    - ``modifier_rank=None``: changes made inside the block are discarded (each rank's piece is kept);
      with ``zero_optimization.enable_sanity_checks`` (parameters made by zero.Init or the engine under
      such a config) a change is an error instead: RuntimeError on every rank at exit (one all-gather
      of a flag then, as DeepSpeed's all-reduce).
    - ``modifier_rank=r`` (a rank of the parameters' group; with MiCS a global rank): on exit rank
      ``r``'s full values are broadcast, each rank keeps its part as its new piece, and each parameter's
      update hooks run (``ZeroParam.register_update_hook``: where the engine's fp32 master copy follows).
    - ``fwd_module``: also register the parameters as external to that module (see external.py).
    - Tensors that are not ZeRO-3 parameters pass through untouched; with none, or ``enabled=False``,
      the block does nothing.

    Parameters are gathered in ds_id order, the same on every rank. Nested blocks may not gather the
    same parameter (RuntimeError), as in DeepSpeed. Parameters still in use by a module (inside a
    forward) stay gathered after the block.
    """

    def __init__(self, params: Union[torch.Tensor, Iterable[torch.Tensor]], modifier_rank: Optional[int] = None,
                 fwd_module: Optional[torch.nn.Module] = None, enabled: bool = True):
        self.modifier_rank = modifier_rank
        self.params: List[ZeroParam] = []
        self._pinned = []  # (GatherMeter, parameters of its model this block holds), while entered
        self._versions = None  # read-only blocks under sanity checks: (param, data_ptr, _version) at entry
        if not enabled:
            return
        if isinstance(params, torch.Tensor):
            params = [params]
        found = {}
        for p in params:
            zp = zero_param_of(p)
            if zp is not None:
                found[id(zp)] = zp
        self.params = sorted(found.values(), key=lambda zp: zp.ds_id)
        if fwd_module is not None:
            for zp in self.params:
                register_external_parameter(fwd_module, zp.param)

    def __enter__(self):
        for zp in self.params:
            if any(isinstance(h, GatheredParameters) for h in zp.holders):
                raise RuntimeError(f"Nested GatheredParameters contexts cannot overlap parameters: "
                                   f"{zp.name} is already gathered by an enclosing GatheredParameters")
        self._agree()
        fetch(self.params, self, FetchSite(FetchKind.GATHERED), check=False)
        for zp in self.params:
            zp.expect_views()  # the block may keep views of the values (t = p.detach().numpy())
        if self.modifier_rank is None and any(zp.sanity_checks for zp in self.params):
            self._versions = [(zp.param, zp.param.data_ptr(), zp.param._version) for zp in self.params]
        self._pin(1)
        return None

    def _agree(self) -> None:
        """One fetch-order agreement per process group at entry, even when nothing has to be gathered:
        a rank that enters alone, or with another modifier_rank (whose exit broadcast would meet another
        collective, or none), fails here on every rank with FetchOrderError naming each rank's block."""
        groups = {}
        for zp in self.params:
            groups.setdefault(zp.group, []).append(zp)
        modifier = -1 if self.modifier_rank is None else self.modifier_rank
        for group, zps in groups.items():
            check_agreement(FetchSite(FetchKind.GATHERED, modifier), [zp.shape for zp in zps], zps[0].ds_id, group,
                            collectives.check_device(group, zps[0].compute_device))

    def _pin(self, sign: int) -> None:
        """Tell each model's GatherMeter how many of its parameters this block holds: a block over a whole
        model turns that model's hooks off (see [Note: whole-model gathered] in model.py)."""
        if sign > 0:
            counts = {}
            for zp in self.params:
                if zp.meter is not None:
                    counts[zp.meter] = counts.get(zp.meter, 0) + 1
            self._pinned = list(counts.items())
        for meter, count in self._pinned:
            meter.pin(sign * count)
        if sign < 0:
            self._pinned = []

    def __exit__(self, exc_type, exc, tb):
        # the broadcast runs even after an exception, so that a rank that failed alone does not leave
        # the others waiting in it
        modified = False
        try:
            self._pin(-1)
            if self.modifier_rank is not None:
                adopt_values_of(self.modifier_rank, self.params)
            elif self._versions is not None:
                modified = self._modified_on_any_rank()
        finally:
            self._versions = None
            release(self.params, self)
        if modified:
            raise RuntimeError("GatheredParameters(modifier_rank=None): an in-place modification of a gathered "
                               "ZeRO-3 parameter was made on some rank; such changes are discarded. Give "
                               "modifier_rank=<rank> to keep that rank's values on every rank")
        return False

    def _modified_on_any_rank(self) -> bool:
        mine = int(any(p.data_ptr() != ptr or p._version != version for p, ptr, version in self._versions))
        groups = {}
        for zp in self.params:
            groups.setdefault(zp.group, zp)
        flags = []
        with internal.section():  # every group's agreement runs (the same groups, in ds_id order, on every rank)
            for group, zp in groups.items():
                device = collectives.check_device(group, zp.compute_device)
                flags += [row[0] for row in collectives.agree([mine], group, device)]
        return any(flags)

    def __repr__(self) -> str:
        return f"GatheredParameters({len(self.params)} parameters, modifier_rank={self.modifier_rank})"
