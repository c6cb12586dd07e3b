"""DeepSpeed's ``deepspeed.runtime.utils`` helpers that training scripts (Megatron-style ones) call on plain
parameter lists: gradient-norm clipping, the weight norm, the overflow check, a call's string form, and
how many parameters the running backward reaches. The engine does its own clipping and overflow checks
(optim/zero_optimizer.py); these are for code that works outside it, with DeepSpeed's semantics:

- ``clip_grad_norm_``: each rank's local norm (mpu: summed over the model-parallel group, a replicated
  parameter counted on model-parallel rank 0), then *averaged* over the data-parallel group, so that
  ranks whose expert (MoE) gradients differ still clip by one number; the gradients are scaled in place.
- ``CheckOverflow``: an inf or nan in any gradient, agreed over the largest expert-parallel group when
  expert parameters are present, and over the model-parallel group with an mpu.
"""
import math
from typing import Any, Iterable, List, Optional, Sequence

import torch

from .. import comm
from ..comm.mpu import is_model_parallel_parameter
from ..moe import groups as moe_groups
from ..moe.params import is_moe_param


def call_to_str(base: str, *args, **kwargs) -> str:
    """``base(*args, **kwargs)`` as source text: ``call_to_str("f", 3, x="a")`` is ``"f(3, x='a')"``."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def _as_list(parameters) -> List[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _mp_rank(mpu) -> int:
    if mpu is None:
        return 0
    getter = getattr(mpu, "get_tensor_model_parallel_rank", None) or mpu.get_model_parallel_rank
    return getter()


def _counted_here(p: torch.Tensor, mpu) -> bool:
    """A parameter replicated over model-parallel ranks counts on model-parallel rank 0 only."""
    return mpu is None or _mp_rank(mpu) == 0 or is_model_parallel_parameter(p)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2, mpu=None) -> torch.Tensor:
    """Scales the gradients of ``parameters`` in place so that their norm is at most ``max_norm`` and returns
    the norm (a tensor), computed as the module docstring says. Collective over the data-parallel group."""
    params = [p for p in _as_list(parameters) if p.grad is not None]
    norm_type = float(norm_type)
    device = params[0].grad.device if params else torch.device("cpu")
    if norm_type == math.inf:
        local = max((p.grad.detach().abs().max().float() for p in params), default=torch.zeros(()))
        total = local.reshape(()).to(device)
        if mpu is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for p in params:
            if _counted_here(p, mpu):
                total += p.grad.detach().float().norm(norm_type) ** 2
        if mpu is not None:
            comm.all_reduce(total, group=mpu.get_model_parallel_group())
        total = total ** (1.0 / norm_type)
    if comm.is_initialized():  # the ranks' norms differ where their experts do: one average for all
        dp = moe_groups.data_parallel_group()
        total = total / comm.get_world_size(dp)
        comm.all_reduce(total, group=dp)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The L2 norm of several norms."""
    return math.sqrt(sum(float(n) ** 2 for n in norm_list))


def get_weight_norm(parameters, norm_type: float = 2, mpu=None) -> float:
    """The norm of the parameters' values (not their gradients); with an mpu summed over its model-parallel
    group (a replicated parameter once). -1 when it is inf or nan, DeepSpeed's overflow mark."""
    params = _as_list(parameters)
    norm_type = float(norm_type)
    if norm_type == math.inf:
        total = torch.tensor([max(float(p.detach().abs().max()) for p in params)])
        if mpu is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=mpu.get_model_parallel_group())
        value = total.item()
    else:
        total = torch.tensor([sum(float(p.detach().float().norm(norm_type)) ** norm_type
                                  for p in params if _counted_here(p, mpu))])
        if mpu is not None:
            comm.all_reduce(total, group=mpu.get_model_parallel_group())
        value = total.item() ** (1.0 / norm_type)
    return -1 if not math.isfinite(value) else value


def _largest_expert_parallel_group():
    size = moe_groups.max_expert_size()
    return moe_groups.expert_parallel_group(moe_groups.group_name(size)) if size else None


class CheckOverflow:
    """Whether any gradient holds an inf or nan, agreed across the ranks that must skip together
    (module docstring). ``param_groups``: lists of parameters."""

    def __init__(self, param_groups: Optional[Sequence[Sequence[torch.Tensor]]] = None, mpu=None,
                 zero_reduce_scatter: bool = False, deepspeed: Any = None):
        self.mpu, self.zero_reduce_scatter, self.deepspeed = mpu, zero_reduce_scatter, deepspeed
        self.params = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or [])

    def check_using_norm(self, norm_group: Sequence[float], reduce_overflow: bool = True) -> bool:
        """Overflow from norms already computed (-1 marks one: get_weight_norm)."""
        flag = torch.tensor([float(-1 in list(norm_group))])
        return self._agree(flag, reduce_over_world=reduce_overflow and self.mpu is None)

    def check(self, param_groups: Optional[Sequence[Sequence[torch.Tensor]]] = None) -> bool:
        params = self.params if param_groups is None else [p for group in param_groups for p in group]
        has_moe = self.has_moe_params if param_groups is None else any(is_moe_param(p) for p in params)
        return self.has_overflow(params, has_moe_params=has_moe)

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        return any(p.grad is not None and self._has_inf_or_nan(p.grad) for p in params)

    def has_overflow(self, params: Iterable[torch.Tensor], has_moe_params: Optional[bool] = None) -> bool:
        flag = torch.tensor([float(self.has_overflow_serial(params))])
        moe = self.has_moe_params if has_moe_params is None else has_moe_params
        world = self.zero_reduce_scatter or (self.deepspeed is not None and
                                             not getattr(self.deepspeed, "enable_backward_allreduce", True))
        return self._agree(flag, reduce_over_world=world, moe=moe)

    def _agree(self, flag: torch.Tensor, reduce_over_world: bool, moe: Optional[bool] = None) -> bool:
        if not comm.is_initialized():
            return bool(flag.item())
        if self.has_moe_params if moe is None else moe:  # an expert's overflow is seen by its whole EP group
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=_largest_expert_parallel_group())
        if self.mpu is not None:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
        elif reduce_over_world:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        return bool(flag.item())

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor, i: int = 0) -> bool:
        return not bool(torch.isfinite(x.detach().float().sum()))


def count_used_parameters_in_backward(parameters: Sequence[torch.nn.Parameter]) -> int:
    """How many of ``parameters`` the running backward pass will reach (their gradient nodes run); called
    from a backward hook. Parameters sharing one node count once; frozen or unreached ones not at all."""
    graph = torch.autograd.graph
    if not hasattr(graph, "_get_grad_fn_or_grad_acc") or not hasattr(torch._C, "_will_engine_execute_node"):
        raise NotImplementedError("count_used_parameters_in_backward needs torch.autograd.graph."
                                  "_get_grad_fn_or_grad_acc (torch >= 2.3)")
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during a backward pass "
                           "(from a backward hook)")
    nodes = set()
    for p in parameters:
        if isinstance(p, torch.Tensor) and p.requires_grad:
            with torch.enable_grad():  # (hooks run with grad off; the leaf's accumulator needs it on)
                node = graph._get_grad_fn_or_grad_acc(p)
            if node is not None:
                nodes.add(node)
    return sum(bool(torch._C._will_engine_execute_node(n)) for n in nodes)


__all__ = ["call_to_str", "clip_grad_norm_", "get_global_norm", "get_weight_norm", "CheckOverflow",
           "count_used_parameters_in_backward"]
