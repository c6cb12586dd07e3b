"""The Muon optimizer under ZeRO (DeepSpeed 0.19's ``"type": "Muon"``: MuonWithAuxAdam).

Which parameters: as DeepSpeed decides at initialize, every trainable parameter with two or more
dimensions whose name contains neither "embed" nor "lm_head" is stepped by Muon (``param.use_muon``
True); the rest (biases, norms, embeddings, the output head) by the auxiliary Adam. Two param groups:
Muon's (lr = muon_lr or lr, default 0.02; momentum 0.95; weight_decay; ns_method "gram") and Adam's
(lr = adam_lr or lr, default 3e-4; betas (0.9, 0.95); eps 1e-10; weight_decay).

The update of a Muon parameter with averaged gradient G, momentum buffer M and factor beta:
    M = lerp(M, G, 1 - beta);  U = lerp(G, M, beta)           (Nesterov)
    O = NewtonSchulz5(U) * sqrt(max(1, rows / cols))    (4-D filters: U viewed as out x rest; 3-D: a
                                                         batch of matrices; rows, cols: the last two dims)
    p = p * (1 - lr * weight_decay) - lr * O
and of an Adam parameter (DeepSpeed's adam_update: eps outside the square root of the corrected v):
    m = lerp(m, G, 1 - b1);  v = lerp(v, G * G, 1 - b2)
    p = p * (1 - lr * weight_decay) - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

Under ZeRO the elementwise parts run on each rank's partition (the momentum buffer is partitioned like
the master); Newton-Schulz needs whole matrices, so before the step (``zero_prepare_step``) each rank
all-gathers its partition of U, orthogonalizes the matrices its partition touches and puts its part of
O where the gradient was: the optimizer step (MuonWithAuxAdam.step, elementwise) then applies it. The
global gradient norm (and clipping) is taken over these updates, as DeepSpeed does. Newton-Schulz runs
in fp32 (DeepSpeed: bf16 or fp16 where the accelerator supports them).

With ``offload_optimizer.device = "nvme"`` the masters, momentum buffers and Adam moments live in swap
files and both halves stream them group by group (optim/muon_nvme.py); ``momentum_in_memory``
(``zero_optimization.save_muon_momentum_buffer_in_memory``) keeps the momentum buffers in host memory
instead, so the orthogonalization reads no swap file.
"""
from typing import Dict, List

import torch

from .. import comm

# the quintic Newton-Schulz coefficients of Muon (Keller Jordan): a fast, not exact, orthogonalization
_A, _B, _C = 3.4445, -4.7750, 2.0315
NS_STEPS = 5
NS_METHODS = ("gram", "standard")
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, method: str = "gram") -> torch.Tensor:
    """An approximately orthogonal matrix with g's singular vectors (singular values near 1), in fp32.

    "standard" iterates X <- a X + (b A + c A^2) X with A = X X^T on the wide orientation of g, scaled
    to spectral norm <= 1. "gram" is the same iteration carried on the small square Gram matrix
    R = X X^T (each step X <- (a I + Z) X with Z = b R + c R^2, so R <- (a I + Z) R (a I + Z)),
    accumulating the product Q of the factors and applying it to X at a restart after step 2 and at
    the end; square matrices use "standard"."""
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    n, m = x.size(-2), x.size(-1)
    if method == "standard" or m <= n:
        for _ in range(steps):
            a = x @ x.mT
            x = _A * x + (_B * a + _C * a @ a) @ x
        return x.mT if tall else x
    restart = 2
    r, q = x @ x.mT, None
    eye = torch.eye(n, dtype=x.dtype, device=x.device)
    for i in range(steps):
        if i == restart:
            x = q @ x
            r, q = x @ x.mT, None
        z = _B * r + _C * r @ r
        q = z + _A * eye if q is None else _A * q + z @ q
        if i < steps - 1 and i + 1 != restart:
            rz = _A * r + z @ r
            r = _A * rz + z @ rz
    x = q @ x
    return x.mT if tall else x


def orthogonalized(u: torch.Tensor, shape: torch.Size, method: str) -> torch.Tensor:
    """Muon's update from the (Nesterov) momentum ``u`` of a parameter of ``shape``, flattened."""
    mat = u.view(shape)
    if mat.dim() == 4:  # convolution filters: one matrix per output channel's row (3-D: a batch of matrices)
        mat = mat.reshape(shape[0], -1)
    scale = max(1.0, shape[-2] / shape[-1]) ** 0.5
    return (newton_schulz(mat, method=method) * scale).reshape(-1)


def uses_muon(name: str, param: torch.nn.Parameter) -> bool:
    """DeepSpeed's rule: 2-D or larger, and not an embedding or the output head (by name)."""
    lowered = name.lower()
    dims = len(getattr(param, "ds_shape", param.shape))  # (a ZeRO-3 parameter's own shape is its piece's)
    return dims >= 2 and "embed" not in lowered and "lm_head" not in lowered


def muon_param_groups(model: torch.nn.Module, groups: List[dict], params: Dict) -> List[dict]:
    """Sets ``use_muon`` on every parameter of ``model`` and regroups the trainable ones of ``groups``
    into Muon's group and Adam's, with the config's params (DeepSpeed ignores other group options)."""
    for name, p in model.named_parameters():
        p.use_muon = uses_muon(name, p)
    given = [p for g in groups for p in g["params"] if p.requires_grad]
    muon = {k: params[k] for k in ("lr", "momentum", "weight_decay", "ns_method") if params.get(k) is not None}
    adam = {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if params.get(k) is not None}
    if params.get("muon_lr") is not None:
        muon["lr"] = params["muon_lr"]
    if params.get("adam_lr") is not None:
        adam["lr"] = params["adam_lr"]
    out = []
    if any(p.use_muon for p in given):
        out.append({**MUON_DEFAULTS, **muon, "params": [p for p in given if p.use_muon], "use_muon": True,
                    "name": "muon-params"})
    if any(not p.use_muon for p in given):
        out.append({**ADAM_DEFAULTS, **adam, "params": [p for p in given if not p.use_muon], "use_muon": False,
                    "name": "adam-params"})
    if "betas" in out[-1]:
        out[-1]["betas"] = tuple(out[-1]["betas"])
    return out


class MuonWithAuxAdam(torch.optim.Optimizer):
    """The elementwise half of Muon under ZeRO: steps flat fp32 masters. In Muon groups the gradient
    must already be the orthogonalized update (``zero_prepare_step`` makes it); Adam groups step
    DeepSpeed's Adam. State: Muon masters "momentum_buffer"; Adam masters "exp_avg", "exp_avg_sq",
    "step"."""

    def __init__(self, param_groups: List[dict], momentum_in_memory: bool = False):
        for group in param_groups:
            if group["use_muon"] and group.get("ns_method", "gram") not in NS_METHODS:
                raise ValueError(f"Muon: ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")
        super().__init__(param_groups, {})
        self.momentum_in_memory = momentum_in_memory  # NVMe offload: the momentum buffers stay out of the swap files

    def group_of(self, master: torch.Tensor) -> dict:
        return next(pg for pg in self.param_groups if any(m is master for m in pg["params"]))

    def nvme_state_keys(self, master: torch.Tensor) -> tuple:
        """The state tensors of ``master``'s group that NVMe offload swaps with it (ZeroOptimizer.attach_nvme)."""
        if self.group_of(master)["use_muon"]:
            return () if self.momentum_in_memory else ("momentum_buffer",)
        return ("exp_avg", "exp_avg_sq")

    def _init_state(self, master: torch.Tensor, state: dict) -> None:
        """A master's state as its first step makes it (zeros), before NVMe offload registers it."""
        if self.group_of(master)["use_muon"]:
            state["momentum_buffer"] = torch.zeros_like(master, dtype=torch.float32)
        else:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(master, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(master, dtype=torch.float32)

    def zero_nvme_step(self, zopt, combined: float) -> None:
        """ZeroOptimizer.step under NVMe offload: both halves' elementwise step, streamed (optim/muon_nvme.py)."""
        from . import muon_nvme  # (it builds on this module's functions)
        muon_nvme.step(self, zopt, combined)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    update = p.grad
                else:
                    update = self._adam(p, group)
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(update, alpha=-lr)
        return loss

    def _adam(self, p, group) -> torch.Tensor:
        state = self.state[p]
        if not state:
            self._init_state(p, state)
        state["step"] += 1
        return adam_update(p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group)

    @torch.no_grad()
    def zero_prepare_step(self, zopt) -> None:
        """ZeroOptimizer.step's hook, after the gradients are averaged: every Muon group's gradient
        partition becomes its part of the orthogonalized update. Collective (one all-gather per group)."""
        if zopt.nvme is not None:
            from . import muon_nvme
            muon_nvme.prepare(self, zopt)
            return
        for g in zopt.flat_groups:
            group = next(pg for pg in self.param_groups if any(m is g.master for m in pg["params"]))
            if not group["use_muon"]:
                continue
            state = self.state[g.master]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g.grad, dtype=torch.float32)
            beta = group["momentum"]
            momentum = state["momentum_buffer"]
            momentum.lerp_(g.grad, 1.0 - beta)
            u = g.grad.lerp(momentum, beta)
            orthogonalize_group(g, u, group.get("ns_method", "gram"), zopt.world, zopt.pg)


def adam_update(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, group: dict) -> torch.Tensor:
    """DeepSpeed's Adam direction at step ``t``, moving the moments ``m``, ``v`` in place (elementwise: a
    slice of a partition gets the bits the whole partition would)."""
    b1, b2 = group["betas"]
    m.lerp_(g, 1.0 - b1)
    v.lerp_(g.square(), 1.0 - b2)
    return (m / (1.0 - b1 ** t)) / ((v / (1.0 - b2 ** t)).sqrt() + group["eps"])


def orthogonalize_group(g, u: torch.Tensor, method: str, world: int, pg) -> None:
    """Writes into g.grad this rank's part of the orthogonalized update of every matrix it touches.
    ``u``: this rank's partition of the Nesterov momentum."""
    sharded = hasattr(g, "zparams")  # stage 3: each parameter cut into equal shards, one per rank
    gather = world > 1 and g.partitioned
    full = u
    if gather:
        full = torch.empty(world * u.numel(), dtype=u.dtype, device=u.device)
        comm.all_gather_into_tensor(full, u.contiguous(), group=pg)
    if sharded:
        per_rank = full.view(world, -1) if gather else full.view(1, -1)
        for p, off, s, n in zip(g.params, g.offsets, g.shards, g.numels):
            whole = per_rank[:, off:off + s].reshape(-1)[:n]
            o = orthogonalized(whole, torch.Size(getattr(p, "ds_shape", p.shape)), method)
            mine = torch.zeros(s * per_rank.size(0), dtype=o.dtype, device=o.device)
            mine[:n] = o
            start = g.rank * s if gather else 0
            g.grad[off:off + s].copy_(mine[start:start + s])
        return
    done = {}
    for piece in g.fragments:
        i = piece.param
        if i not in done:
            off, n = g.offsets[i], g.numels[i]
            done[i] = orthogonalized(full[off:off + n], g.params[i].shape, method)
        o = done[i]
        g.grad[piece.part_offset:piece.part_offset + piece.length].copy_(
            o[piece.param_offset:piece.param_offset + piece.length])


__all__ = ["MuonWithAuxAdam", "adam_update", "orthogonalize_group", "muon_param_groups", "newton_schulz",
           "orthogonalized", "uses_muon",
           "MUON_DEFAULTS", "ADAM_DEFAULTS"]
