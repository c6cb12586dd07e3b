"""Mixture-of-experts (expert-parallel) parameters at ZeRO stages 0-2.

With ``ep_size`` E > 1 (zero_ext/moe/layer.py), the ranks of one expert-parallel group hold different
experts, and the ranks holding the same experts form that expert's expert-data-parallel (EDP) group, of
N / E ranks. An expert parameter (``allreduce = False``, ``group_name = "ep_size_E"``) therefore lives in
its own *domain*: its optimizer groups are flat groups partitioned over the EDP group, its gradients are
reduced over the EDP group only, and its starting values come from the EDP group's first rank. The
average is still over all N ranks, as DeepSpeed's: each replica's gradient already sums the tokens of
the E ranks that routed to it (the all-to-all's backward), so the EDP sum is the sum over every token.

Everything else is unchanged: the dense domain is the data-parallel group. With E = 1 the EDP group is
the whole world and the expert parameters are ordinary ones (no domain of their own).

- ``configure_moe(model)``: calls ``set_deepspeed_parallelism`` on each MoE layer (DeepSpeed's engine
  does) and returns the domains by group name.
- ``split_base_groups``: a base optimizer group that mixes domains (the config optimizer's, or a
  client's ``Adam(model.parameters())``) cut into one group per domain;
  ``domain_of_group``: the domain of one optimizer group.
- ``DomainReducers``: one reducer per domain behind the single reducer interface ZeroOptimizer uses.
"""
from typing import Any, Dict, List, NamedTuple, Optional

import torch

from .. import comm
from ..config.errors import UnsupportedCombinationError
from ..ops.functional import grad_sqnorm
from ..moe.params import is_moe_param


class Domain(NamedTuple):
    """The expert-data-parallel group of one ``group_name``, and this rank's place in it."""
    name: str
    pg: Any
    world: int
    rank: int
    ep_group: Any  # the expert-parallel group (for the stage-0 norm: its ranks hold different experts)


def moe_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's MoE layers (DeepSpeed's test: a module with ``set_deepspeed_parallelism``)."""
    return [m for m in model.modules() if callable(getattr(m, "set_deepspeed_parallelism", None))]


def configure_moe(model: torch.nn.Module, stage: int, dense_world: int, mpu=None,
                  use_data_before_expert_parallel: bool = False) -> Dict[str, Domain]:
    """Sets up every MoE layer's process groups and returns the expert domains (group name -> Domain) of
    the layers whose ``ep_size`` > 1. Refuses what zero_ext does not run: expert parallelism at ZeRO
    stage 3, and with an mpu."""
    layers = moe_layers(model)
    if not layers:
        return {}
    if mpu is not None:
        raise UnsupportedCombinationError("zero_ext.initialize: mixture-of-experts layers together with an mpu "
                                          "(model parallelism) are not supported; train the MoE model "
                                          "data-parallel only")
    for layer in layers:
        layer.set_deepspeed_parallelism(use_data_before_expert_parallel)
    from ..moe import groups  # (the MoE package is loaded only for MoE models)
    domains: Dict[str, Domain] = {}
    for p in model.parameters():
        if not is_moe_param(p) or p.group_name in domains:
            continue
        pg = groups.expert_data_parallel_group(p.group_name)
        world = comm.get_world_size(pg) if comm.is_initialized() else 1
        if world == dense_world:
            continue  # ep_size 1: the expert-data-parallel group is the data-parallel group
        domains[p.group_name] = Domain(p.group_name, pg, world, comm.get_rank(pg),
                                       groups.expert_parallel_group(p.group_name))
    if domains and stage == 3:
        names = ", ".join(sorted(domains))
        raise UnsupportedCombinationError(f"zero_ext.initialize: expert parallelism ({names}) is not supported at "
                                          "ZeRO stage 3 (stage 3 partitions every parameter over all ranks, but the "
                                          "ranks of an expert-parallel group hold different experts); use stage 0, "
                                          "1 or 2, or ep_size=1")
    return domains


def split_base_groups(base: torch.optim.Optimizer, domains: Dict[str, Domain]) -> None:
    """Cuts each base optimizer group that mixes domains into one group per domain, with the same
    options (the expert ones named after their domain, ``moe`` True), as
    split_params_into_different_moe_groups_for_optimizer would have made them: a group is one flat
    partition over one process group. A client's ``Adam(model.parameters())`` works so, as at
    DeepSpeed's stage 0. Before the first step only: the groups have no state yet."""
    out: List[Dict[str, Any]] = []
    for group in base.param_groups:
        by_domain: Dict[Optional[str], List[torch.nn.Parameter]] = {}
        for p in group["params"]:
            by_domain.setdefault(_domain_name(p, domains), []).append(p)
        if len(by_domain) <= 1:
            out.append(group)
            continue
        if any(p in base.state for p in group["params"]):
            raise ValueError("zero_ext.initialize: an optimizer group mixing expert-parallel and other parameters "
                             "already has optimizer state; build its groups with deepspeed.moe.utils."
                             "split_params_into_different_moe_groups_for_optimizer before the first step")
        group["params"] = by_domain.pop(None, [])
        out.append(group)
        out += [{**group, "params": params, "name": name, "moe": True} for name, params in by_domain.items()]
    base.param_groups[:] = out


def _domain_name(p: torch.nn.Parameter, domains: Dict[str, Domain]) -> Optional[str]:
    return p.group_name if is_moe_param(p) and p.group_name in domains else None


def domain_of_group(params: List[torch.nn.Parameter], domains: Dict[str, Domain]) -> Optional[Domain]:
    """The domain of one optimizer group's parameters (None: the dense one); split_base_groups made
    every group hold one domain's."""
    name = _domain_name(params[0], domains)
    return None if name is None else domains[name]


class DomainReducers:
    """The reducers of each domain (the dense one first, then the expert ones by name) behind the one
    reducer interface ZeroOptimizer and the engine use: each call goes to all of them. Each reduces its
    own groups over its own process group, so dense and expert gradients never share a bucket."""

    def __init__(self, reducers: List[Any], worlds: List[int]):
        self.reducers, self.worlds = reducers, worlds

    def reduce(self, world: int) -> None:
        for r, w in zip(self.reducers, self.worlds):
            r.reduce(w)

    def _each(self, method: str, *args) -> None:
        for r in self.reducers:
            getattr(r, method)(*args)

    def after_step(self) -> None:
        self._each("after_step")

    def free_buffers(self) -> None:
        self._each("free_buffers")

    def remove_hooks(self) -> None:
        self._each("remove_hooks")

    def begin_deferral(self) -> None:
        self._each("begin_deferral")

    def end_deferral(self, flush: bool) -> None:
        self._each("end_deferral", flush)

    def tensors(self):
        return [kt for r in self.reducers for kt in r.tensors()]

    @property
    def buffers(self) -> List[torch.Tensor]:
        return [b for r in self.reducers for b in r.buffers]


def stage0_expert_sq(groups, device) -> torch.Tensor:
    """Stage 0's squared gradient norm of the expert groups (those with a ``domain``), fp64: each
    domain's local sum added up over its expert-parallel group, whose ranks hold different experts (the
    replicas in the other expert-parallel groups are the same values). Stages 1-2 need nothing of this:
    there every expert partition is counted once by the sum over all ranks."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    by_name: Dict[str, List] = {}
    for g in groups:
        if g.domain is not None:
            by_name.setdefault(g.domain.name, []).append(g)
    for name in sorted(by_name):  # the same order on every rank
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for g in by_name[name]:
            sq += g.grad_sq_norm() if not g.grad.is_cpu else grad_sqnorm(g.grad)
        comm.all_reduce(sq, group=by_name[name][0].domain.ep_group)
        total += sq
    return total
