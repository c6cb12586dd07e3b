"""The router: which experts each token goes to, at which slot of the expert's buffer, with what weight.

Every gate works on a ``[S, E]`` logit matrix (S tokens, E experts, fp32) and decides in four steps:
1. choose: top-1 (argmax), top-2 (argmax, then the best other expert, by default sampled with Gumbel
   noise), or top-k (the k largest probabilities); ``used_token`` (0/1 per token) removes unused tokens;
2. count: ``exp_counts`` (tokens sent to each expert, before any drop) and the load-balancing loss
   ``l_aux`` (E x sum over experts of mean probability x fraction of first choices; top-k divides by k);
3. fit: each expert takes at most ``capacity`` tokens. With ``drop_tokens`` the capacity is
   ceil(S / E x capacity_factor x k') (k' = 2 for top-2, k for top-k), at least ``min_capacity``, and
   the tokens over it are dropped (top-1: random ones kept with ``use_rts``, else the first in token
   order; top-2: first choices before second choices, each in token order; top-k: the most probable,
   or the first with drop_policy "position"). Without ``drop_tokens`` the capacity is the largest
   count, made equal across the expert-parallel group (a MAX all-reduce), so nothing is dropped;
4. weigh: top-1 weighs a kept token by its probability; top-2 and top-k by its probabilities
   renormalised over the routes kept.

A token's slot ("location") in an expert's buffer is its place in token order among the routes kept by
that expert. The result is DeepSpeed's: dense, ``(l_aux, combine_weights [S, E, C], dispatch_mask,
exp_counts)``, or with ``sparse_routes`` one row per route choice: ``(l_aux, capacity, E, indices [k, S]
(-1: dropped), locations [k, S], gates [k, S], exp_counts)``, which MOELayer uses (dispatch.py).
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .. import comm
from . import groups

_NOISE_POLICIES = (None, "None", "Jitter", "RSample")


def multiplicative_jitter(x: torch.Tensor, device: Optional[torch.device] = None, epsilon: float = 1e-2):
    """x times noise uniform in [1 - epsilon, 1 + epsilon] (the "Jitter" policy, on the gate's input)."""
    if epsilon == 0:
        return x
    noise = torch.empty(x.shape, device=device or x.device, dtype=x.dtype).uniform_(1.0 - epsilon, 1.0 + epsilon)
    return x * noise


def gumbel_rsample(shape, device: Optional[torch.device] = None) -> torch.Tensor:
    """Standard Gumbel noise: -log(-log(U)), U uniform in (0, 1)."""
    u = torch.rand(shape, device=device).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """ceil(num_tokens / num_experts x capacity_factor), at least min_capacity; in fp32 arithmetic, so
    that values on an integer boundary round as DeepSpeed's do."""
    per_expert = torch.tensor(num_tokens / num_experts, dtype=torch.float32)
    cap = int(torch.ceil(per_expert * torch.tensor(capacity_factor, dtype=torch.float32)))
    return max(cap, int(min_capacity))


def undropped_capacity(exp_counts: torch.Tensor, ep_group=None) -> int:
    """The capacity that drops nothing: the largest expert count on any rank of the EP group (every
    rank's buffers must have one shape for the all-to-all), padded to a multiple of the tensor-parallel
    size when the experts are not split (the dispatch then cuts the buffers that many ways)."""
    cap = exp_counts.max().to(torch.int64).reshape(())
    if ep_group is not None and comm.get_world_size(group=ep_group) > 1:
        cap = cap.clone()
        comm.all_reduce(cap, op=comm.ReduceOp.MAX, group=ep_group)
    cap = int(cap)
    if groups.expert_tensor_parallel_world_size() == 1:
        tp = groups.tensor_parallel_world_size()
        cap = math.ceil(cap / tp) * tp
    return cap


def _apply_used(mask: torch.Tensor, used_token: Optional[torch.Tensor]) -> torch.Tensor:
    if used_token is None:
        return mask
    return mask * (used_token.reshape(-1, 1) != 0).to(mask.dtype)


def _balance_loss(gates: torch.Tensor, first_choices: torch.Tensor) -> torch.Tensor:
    """E x sum_e (mean probability of e) x (fraction of tokens choosing e)."""
    return (gates.mean(dim=0) * first_choices.float().mean(dim=0)).sum() * gates.shape[1]


def _keep_best(mask: torch.Tensor, priority: torch.Tensor, cap: int) -> torch.Tensor:
    """mask (0/1, [S, E]) keeping, per expert, the ``cap`` routed tokens of highest priority."""
    if cap >= mask.shape[0]:
        return mask
    ranked = torch.where(mask.bool(), priority, torch.full_like(priority, -1.0))
    chosen = torch.topk(ranked, k=cap, dim=0).indices
    return mask * torch.zeros_like(mask).scatter_(0, chosen, 1)


def _keep_first(mask: torch.Tensor, cap: int, offset=0) -> torch.Tensor:
    """mask keeping the routes whose slot (place in token order, after ``offset`` slots) is below cap."""
    return mask * ((torch.cumsum(mask, dim=0) - 1 + offset) < cap).to(mask.dtype)


def _slots(mask: torch.Tensor, offset=0) -> torch.Tensor:
    """Each kept route's place in its expert's buffer, [S, E] (0 where not routed)."""
    return (torch.cumsum(mask, dim=0) - 1 + offset) * mask


def _dense(indices, locations, weights, num_experts: int, cap: int):
    """combine_weights [S, E, C] and dispatch_mask from the per-route rows (dropped rows: index -1)."""
    k, s = indices.shape
    combine = weights.new_zeros(s, num_experts, cap)
    tokens = torch.arange(s, device=indices.device)
    for r in range(k):
        kept = indices[r] >= 0
        combine = combine.index_put((tokens[kept], indices[r][kept].long(), locations[r][kept].long()),
                                    weights[r][kept], accumulate=True)
    return combine, combine.bool()


def _result(l_aux, cap, num_experts, indices, locations, weights, exp_counts, sparse_routes):
    if sparse_routes:
        return (l_aux, cap, num_experts, indices.to(torch.int32), locations.to(torch.int32), weights, exp_counts)
    combine, dispatch = _dense(indices, locations, weights, num_experts, cap)
    return l_aux, combine, dispatch, exp_counts


def _routes(choice: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor):
    """Per-route rows for one choice column ([S] expert ids): index (-1 if dropped) and location."""
    kept = mask.gather(1, choice.unsqueeze(1)).squeeze(1) > 0
    index = torch.where(kept, choice, torch.full_like(choice, -1))
    return index, slots.gather(1, choice.unsqueeze(1)).squeeze(1) * kept, kept


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
               used_token: Optional[torch.Tensor] = None, noisy_gate_policy: Optional[str] = None,
               drop_tokens: bool = True, use_rts: bool = True, ep_group=None, sparse_routes: bool = False,
               use_tutel: bool = False) -> Tuple:
    """Top-1 gating (Switch): each token to its most probable expert ("RSample": the argmax of the
    logits plus Gumbel noise)."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    if num_tokens < min_capacity:
        raise ValueError(f"top-1 gating: {num_tokens} tokens, fewer than min_capacity {min_capacity}; set "
                         "min_capacity (at most the tokens per forward) lower or send more tokens")
    scores = logits.detach() + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" \
        else gates.detach()
    choice = torch.argmax(scores, dim=1)
    mask = _apply_used(F.one_hot(choice, num_experts), used_token)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = _balance_loss(gates, mask)
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor, min_capacity)
        if use_rts:  # random token selection: a random priority among the routed tokens
            mask = _keep_best(mask, torch.rand(mask.shape, device=mask.device), cap)
        else:
            mask = _keep_first(mask, cap)
    else:
        cap = undropped_capacity(exp_counts, ep_group)
    index, location, kept = _routes(choice, mask, _slots(mask))
    weight = gates.gather(1, choice.unsqueeze(1)).squeeze(1) * kept
    return _result(l_aux, cap, num_experts, index.unsqueeze(0), location.unsqueeze(0), weight.unsqueeze(0),
                   exp_counts, sparse_routes)


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False, *,
               used_token: Optional[torch.Tensor] = None) -> Tuple:
    """Top-2 gating (GShard): the most probable expert, then the best other one by logit (plus Gumbel
    noise with ``top2_2nd_expert_sampling``); first choices take the buffers' first slots."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = _apply_used(F.one_hot(first, num_experts), used_token)
    scores = logits.detach().clone()
    if top2_2nd_expert_sampling:
        scores += gumbel_rsample(scores.shape, scores.device)
    second = torch.argmax(scores.scatter(1, first.unsqueeze(1), float("-inf")), dim=1)
    mask2 = _apply_used(F.one_hot(second, num_experts), used_token)
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    l_aux = _balance_loss(gates, mask1)
    firsts = mask1.sum(dim=0, keepdim=True)  # second choices queue behind all first choices
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1, mask2 = _keep_first(mask1, cap), _keep_first(mask2, cap, firsts)
    else:
        cap = undropped_capacity(exp_counts, ep_group)
    index1, location1, kept1 = _routes(first, mask1, _slots(mask1))
    index2, location2, kept2 = _routes(second, mask2, _slots(mask2, firsts))
    w1 = gates.gather(1, first.unsqueeze(1)).squeeze(1) * kept1
    w2 = gates.gather(1, second.unsqueeze(1)).squeeze(1) * kept2
    total = torch.clamp(w1 + w2, min=torch.finfo(gates.dtype).eps)
    return _result(l_aux, cap, num_experts, torch.stack([index1, index2]), torch.stack([location1, location2]),
                   torch.stack([w1 / total, w2 / total]), exp_counts, sparse_routes)


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, drop_policy: str = "probs", sparse_routes: bool = False, *,
               used_token: Optional[torch.Tensor] = None) -> Tuple:
    """Top-k gating: the k most probable experts per token. Over capacity, ``drop_policy`` "probs" keeps
    each expert's most probable tokens, "position" its first ones in token order."""
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"topkgating: drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"topkgating: k={k} must be between 1 and the {num_experts} experts")
    top_idx = torch.topk(gates, k=k, dim=1).indices
    mask = _apply_used(torch.zeros_like(gates, dtype=torch.int64).scatter_(1, top_idx, 1), used_token)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = _balance_loss(gates, mask) / k
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        mask = _keep_best(mask, gates.detach(), cap) if drop_policy == "probs" else _keep_first(mask, cap)
    else:
        cap = undropped_capacity(exp_counts, ep_group)
    slots = _slots(mask)
    kept_gates = gates * mask
    kept_gates = kept_gates / torch.clamp(kept_gates.sum(dim=1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    rows = [_routes(top_idx[:, r], mask, slots) for r in range(k)]
    weights = torch.stack([kept_gates.gather(1, top_idx[:, r:r + 1]).squeeze(1) for r in range(k)])
    return _result(l_aux, cap, num_experts, torch.stack([row[0] for row in rows]),
                   torch.stack([row[1] for row in rows]), weights, exp_counts, sparse_routes)


class TopKGate(torch.nn.Module):
    """The gate: a bias-free linear map to one logit per expert (``wg``, computed in fp32), then top-1,
    top-2 or top-k gating. Training uses ``capacity_factor`` and the noise policy; eval
    ``eval_capacity_factor`` and no noise."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if noisy_gate_policy not in _NOISE_POLICIES:
            raise ValueError(f"noisy_gate_policy must be one of None, 'None', 'Jitter', 'RSample', got "
                             f"{noisy_gate_policy!r}")
        if not 1 <= k <= num_experts:
            raise ValueError(f"MoE gate: k={k} must be between 1 and num_experts={num_experts}")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, input: torch.Tensor, used_token: Optional[torch.Tensor] = None, sparse_routes: bool = False,
                use_tutel: bool = False) -> Tuple:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep_group, sparse_routes)
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling, sparse_routes, used_token=used_token)
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                          sparse_routes=sparse_routes, used_token=used_token)
