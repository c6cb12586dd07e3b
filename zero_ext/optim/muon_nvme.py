"""Muon (MuonWithAuxAdam, optim/muon.py) with ``offload_optimizer.device = "nvme"``: the step streamed
through the NVMe state store group by group.

What the swap files hold (ZeroOptimizer.attach_nvme, keys from MuonWithAuxAdam.nvme_state_keys): per
store group (a stage-3 sub-group, a stage-1/2 partition, or one slice of sub_group_size elements of it)
the fp32 master, then the Muon group's momentum buffer or the Adam group's two moments. With
``zero_optimization.save_muon_momentum_buffer_in_memory`` (DeepSpeed 0.19) the Muon files hold only the
master: the momentum buffer stays in host memory, a whole-partition tensor in the optimizer state (where
memory_breakdown counts it), and the orthogonalization reads no swap file.

Muon needs whole matrices while the store holds pieces, so the step runs in two streamed passes, in the
order ZeroOptimizer.step calls them:

1. ``prepare`` (before the global norm): for each piece of a Muon group, read its momentum, move it
   (M = lerp(M, G, 1 - beta)) and turn the gradient piece into the Nesterov momentum in place
   (G = lerp(G, M, beta)); the momentum is written back. Then, group by group, as without NVMe, the
   gradient partition is all-gathered, every matrix it touches orthogonalized, and this rank's part of
   the update written where the gradient was (muon.orthogonalize_group): the gradient partition is in
   memory anyway, so the whole-matrix work needs no more than the non-offloaded path.
2. ``step`` (after norm and clipping): for each piece of every group, read master and state, apply the
   elementwise update (Muon: the orthogonalized update; Adam: DeepSpeed's Adam), write the new values
   into the model's copy, and write master and state back.

Every operation is the non-offloaded path's on a slice of the same tensors, elementwise, so the result
is bit-identical to Muon without NVMe (tests/test_optim_muon_nvme.py).
"""
import contextlib
from typing import Iterator, List, Tuple

import torch

from .muon import adam_update, orthogonalize_group


def _ranges(zopt, k: int) -> List[Tuple[object, int, int]]:
    """(store key, a, b) of each piece of group k: the slices of a stage-1/2 partition larger than
    sub_group_size, else the whole group."""
    if k in zopt._slices:
        return [((k, j), a, b) for j, (a, b) in enumerate(zopt._slices[k])]
    g = zopt.flat_groups[k]
    return [(k, 0, g.hi - g.lo)]


def _pieces(base, zopt, ks: List[int]) -> Iterator[Tuple[int, int, int, List[torch.Tensor]]]:
    """(k, a, b, [master, *state]) for each piece of groups ``ks``, its tensors in memory while the body
    runs and written back after it. A group held in memory by ZeroOptimizer.materialized() comes whole,
    from the optimizer state."""
    streamed, key_range, held = [], {}, []
    for k in ks:
        if k in zopt._materialized:
            held.append(k)
            continue
        for key, a, b in _ranges(zopt, k):
            streamed.append(key)
            key_range[key] = (k, a, b)
    for key in zopt.nvme.stream(streamed, *zopt._pipeline):
        k, a, b = key_range[key]
        yield k, a, b, zopt.nvme.tensors(key)
    for k in held:
        g = zopt.flat_groups[k]
        state = base.state[g.master]
        yield k, 0, g.hi - g.lo, [g.master] + [state[key] for key in zopt._state_keys(g)]


def _momentum(base, zopt, k: int, a: int, b: int, stored: List[torch.Tensor]) -> torch.Tensor:
    """Group k's momentum over [a, b): the swapped tensor in hand, or a view of the in-memory buffer."""
    if not base.momentum_in_memory:
        return stored[0]
    g = zopt.flat_groups[k]
    state = base.state[g.master]
    if "momentum_buffer" not in state:  # (zeros: what the first step would start from)
        state["momentum_buffer"] = torch.zeros(g.hi - g.lo, dtype=torch.float32, device=g.grad.device)
    return state["momentum_buffer"][a:b]


@torch.no_grad()
def prepare(base, zopt) -> None:
    """Pass 1: every Muon group's gradient partition becomes its part of the orthogonalized update.
    Collective (one all-gather per Muon group, in group order on every rank)."""
    groups = [base.group_of(g.master) for g in zopt.flat_groups]
    muon = [k for k, group in enumerate(groups) if group["use_muon"]]
    if base.momentum_in_memory:  # nothing to read: the momentum and the gradient are both in memory
        pieces = ((k, a, b, []) for k in muon for _, a, b in _ranges(zopt, k))
    else:
        pieces = ((k, a, b, stored[1:]) for k, a, b, stored in _pieces(base, zopt, muon))
    for k, a, b, stored in pieces:
        beta = groups[k]["momentum"]
        grad = zopt.flat_groups[k].grad[a:b]
        momentum = _momentum(base, zopt, k, a, b, stored)
        momentum.lerp_(grad, 1.0 - beta)
        grad.lerp_(momentum, beta)  # the Nesterov momentum, in the gradient's place
    for k in muon:
        g = zopt.flat_groups[k]
        orthogonalize_group(g, g.grad, groups[k].get("ns_method", "gram"), zopt.world, zopt.pg)


@torch.no_grad()
def step(base, zopt, combined: float) -> None:
    """Pass 2: the elementwise step of every group, piece by piece; the gradients are unscaled and clipped
    by ``combined`` first, as ZeroOptimizer.step does for a torch optimizer."""
    if combined != 1.0:
        for g in zopt.flat_groups:
            g.grad.mul_(combined)
    groups = [base.group_of(g.master) for g in zopt.flat_groups]
    for k, group in enumerate(groups):  # Adam counts one step per group, however many pieces it has
        if not group["use_muon"]:
            state = base.state[zopt.flat_groups[k].master]
            state["step"] = int(state.get("step", 0)) + 1
    for k, a, b, (master, *states) in _pieces(base, zopt, list(range(len(groups)))):
        g, group = zopt.flat_groups[k], groups[k]
        grad = g.grad[a:b]
        if group["use_muon"]:
            update = grad
        else:
            update = adam_update(grad, *states, base.state[g.master]["step"], group)
        lr, wd = group["lr"], group["weight_decay"]
        if wd:
            master.mul_(1.0 - lr * wd)
        master.add_(update, alpha=-lr)
        with _lp_resident(zopt, k):  # the model's copy of these elements
            g.flat[g.lo + a:g.lo + b].copy_(master)


def _lp_resident(zopt, k: int):
    """With offload_param nvme the group's 16-bit pieces are in swap files: in memory for the write."""
    if zopt.nvme_pieces is None:
        return contextlib.nullcontext()
    return zopt.nvme_pieces.resident_key(("lp", k), modified=True)


__all__ = ["prepare", "step"]
