"""The mixture-of-experts layer (DeepSpeed's ``deepspeed.moe.layer.MoE``) and its parts.

``MoE(hidden_size, expert, num_experts, ep_size, k, ...)`` holds ``num_experts / ep_size`` copies of
``expert`` on each rank: EP rank r's local expert i is global expert r x L + i (L local experts), under
``deepspeed_moe.experts.deepspeed_experts.<i>`` (DeepSpeed's module names, so state_dict keys match).
Each copy's parameters are marked ``allreduce = False`` and ``group_name = "ep_size_<ep_size>"``: the
engine averages their gradients over the expert-data-parallel group only (groups.py). The gate
(``deepspeed_moe.gate.wg``) and everything else are ordinary dense parameters.

A forward: the gate routes the ``[..., M]`` tokens (gating.py), they are packed into an ``[E, C, M]``
buffer, the EP group's all-to-all hands each rank its experts' rows from every rank, the local experts
run, a second all-to-all brings the results home, and each token's output is the gate-weighted sum of
its experts' (dispatch.py). It returns ``(output, l_aux, exp_counts)``: add ``l_aux`` (times a small
coefficient) to the loss to balance the experts. With ``use_residual`` (PR-MoE) a dense copy of the
expert runs on every token too, mixed with the MoE output by a learnt softmax coefficient per token.

The EP group is handed over by ``set_deepspeed_parallelism`` (deepspeed.initialize calls it on every
module that has it); before that a layer with ``ep_size`` > 1 refuses to run.
"""
import copy
import logging
import time
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from . import groups
from .dispatch import _AllToAll, _route_slots, _sparse_decode, _sparse_encode
from .gating import TopKGate
from .mappings import drop_tokens, gather_tokens

logger = logging.getLogger("zero_ext.moe")

try:
    import tutel  # noqa: F401
    TUTEL_INSTALLED = True
except Exception:  # noqa: BLE001 - any failure to import means "not usable"
    TUTEL_INSTALLED = False


class Experts(torch.nn.Module):
    """``num_local_experts`` deep copies of ``expert`` (``deepspeed_experts``), their parameters marked as
    expert parameters of ``expert_group_name``. The input ``[G, L, C, M]`` is cut along dim 1: expert i
    gets ``[G, 1, C, M]``; a tuple output's first element is used (a bias returned beside it is dropped)."""

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1,
                 expert_group_name: Optional[str] = None) -> None:
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for local in self.deepspeed_experts:
            for param in local.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs: List[torch.Tensor] = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)


class MOELayer(torch.nn.Module):
    """Gate, dispatch, the EP all-to-all, the local experts, and back (module docstring). After a forward
    ``l_aux`` and ``exp_counts`` hold the gate's loss and per-expert token counts."""

    def __init__(self, gate: torch.nn.Module, experts: torch.nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.ep_group_set = False
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None
        if use_tutel:  # as DeepSpeed without tutel: its own dispatch (the same numbers), with a warning
            reason = "zero_ext does not use tutel's kernels" if TUTEL_INSTALLED else "tutel is not installed"
            logger.warning("MoE use_tutel=True: %s; using zero_ext's dispatch instead", reason)
        self.use_tutel = False

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group
        self.ep_group_set = True
        self.gate._set_ep_group(ep_group)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        return _AllToAll.apply(self.ep_group, x) if self.ep_size > 1 else x.contiguous()

    def forward(self, *input: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.ep_size > 1 and not self.ep_group_set:
            raise RuntimeError(f"MoE layer with ep_size={self.ep_size} has no expert-parallel group yet: pass the "
                               "model to deepspeed.initialize (or call set_deepspeed_parallelism() on each MoE "
                               "module, on every rank) before its first forward")
        started = time.perf_counter() if self.wall_clock_breakdown else 0.0
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        width = hidden.shape[-1]
        tokens = hidden.reshape(-1, width)
        self.l_aux, cap, num_experts, indices, locations, weights, self.exp_counts = self.gate(
            tokens, used_token, True, False)
        cap = int(cap)
        slots = _route_slots(indices, locations, num_experts, cap)
        dispatched = _sparse_encode(tokens, slots, num_experts, cap)

        tp = groups.tensor_parallel_world_size()
        experts_split = groups.expert_tensor_parallel_world_size() > 1
        if tp > 1:  # the tensor-parallel ranks hold the same tokens: each sends its 1/tp of the slots
            dispatched = drop_tokens(dispatched, dim=1)
        t0 = time.perf_counter() if self.wall_clock_breakdown else 0.0
        dispatched = self._exchange(dispatched)
        if self.wall_clock_breakdown:
            self.time_falltoall = (time.perf_counter() - t0) * 1000.0
        if tp > 1 and experts_split:  # a split expert needs every token
            dispatched = gather_tokens(dispatched, dim=1)

        out = self.experts(dispatched.reshape(self.ep_size, self.num_local_experts, -1, width))
        out = out.reshape(self.ep_size * self.num_local_experts, -1, width)
        if tp > 1 and experts_split:
            out = drop_tokens(out, dim=1)
        t0 = time.perf_counter() if self.wall_clock_breakdown else 0.0
        out = self._exchange(out)
        if self.wall_clock_breakdown:
            self.time_salltoall = (time.perf_counter() - t0) * 1000.0
        if tp > 1:
            out = gather_tokens(out, dim=1)

        combined = _sparse_decode(out.reshape(num_experts * cap, width), slots, weights, tokens.shape[0])
        if self.wall_clock_breakdown:
            self.time_moe = (time.perf_counter() - started) * 1000.0
        return combined.reshape(hidden.shape)


class MoE(torch.nn.Module):
    """DeepSpeed's MoE layer (module docstring). ``forward(hidden_states, used_token=None)`` returns
    ``(output, l_aux, exp_counts)``; ``used_token`` (0/1 per token, the tokens of ``hidden_states``
    flattened) keeps the tokens marked 0 away from every expert (their MoE output is zero).

    Arguments as DeepSpeed's: ``k`` experts per token (1, 2, or more: top-k), ``capacity_factor`` /
    ``eval_capacity_factor`` (training / eval), ``min_capacity``, ``drop_tokens`` (False: no token is ever
    dropped), ``use_rts`` (top-1: keep random tokens over capacity), ``noisy_gate_policy`` (None, 'Jitter',
    'RSample'; training only), ``top2_2nd_expert_sampling`` (top-2: Gumbel-sampled second expert),
    ``use_tutel`` (accepted, with a warning: zero_ext's own dispatch is used),
    ``enable_expert_tensor_parallelism`` (experts split over the mpu's tensor-parallel ranks; needs an mpu).
    """

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1,
                 k: int = 1, capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
            raise ValueError(f"MoE: num_experts ({num_experts}) must be a positive multiple of ep_size ({ep_size}): "
                             "each rank of an expert-parallel group holds num_experts / ep_size experts")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = groups.group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        logger.debug("MoE layer: %d experts, %d per rank, ep_size %d", num_experts, self.num_local_experts, ep_size)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)  # per token: weight of the MoE vs the dense path

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Makes this layer's expert groups (if no layer made them yet; every rank must call this, in the
        same order) and hands the EP group to the layer."""
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.enable_expert_tensor_parallelism and groups.get_mpu() is None:
            raise ValueError("MoE enable_expert_tensor_parallelism=True needs an mpu (Megatron's model-parallel "
                             "unit, passed as deepspeed.initialize(mpu=...)): without tensor parallelism there is "
                             "nothing to split the experts over; set it to False")
        if self.expert_group_name not in groups.expert_parallel_groups():
            if self.enable_expert_tensor_parallelism:
                groups.create_expert_data_and_model_parallel(self.ep_size, groups.get_mpu(),
                                                             use_data_before_expert_parallel_)
            else:
                groups.create_expert_and_data_parallel(self.ep_size, use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups.expert_parallel_group(self.expert_group_name))

    def forward(self, hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + dense * mix[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
