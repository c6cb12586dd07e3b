"""Tokens across the tensor-parallel ranks of an mpu (DeepSpeed's ``deepspeed.moe.mappings``).

With tensor parallelism the t ranks of a tensor-parallel group hold the same tokens. Before the
all-to-all each keeps only its 1/t of the capacity slots (``drop_tokens``: less to send, and each token
reaches an unsplit expert once); afterwards the parts are gathered back (``gather_tokens``). Each is the
other's gradient. Without an mpu, or with t = 1, both return their input.
"""
from typing import Any

import torch

from .. import comm
from . import groups


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    t = groups.tensor_parallel_world_size()
    if t == 1:
        return x
    x = x.contiguous()
    flat = torch.empty(t * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(flat, x, group=groups.tensor_parallel_group())
    return torch.cat([part.view_as(x) for part in flat.chunk(t)], dim=dim)


def _drop(x: torch.Tensor, dim: int) -> torch.Tensor:
    t = groups.tensor_parallel_world_size()
    if t == 1:
        return x
    if x.shape[dim] % t:
        raise ValueError(f"MoE token split: dimension {dim} ({x.shape[dim]}) is not divisible by the "
                         f"tensor-parallel size {t}")
    part = x.shape[dim] // t
    return x.narrow(dim, groups.tensor_parallel_rank() * part, part)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _gather(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _drop(grad, ctx.dim), None


class _DropTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _drop(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _gather(grad, ctx.dim), None


def gather_tokens(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The tensor-parallel ranks' parts of ``x`` concatenated along ``dim``."""
    return x if groups.tensor_parallel_world_size() == 1 else _GatherTokens.apply(x, dim)


def drop_tokens(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This tensor-parallel rank's 1/t of ``x`` along ``dim``."""
    return x if groups.tensor_parallel_world_size() == 1 else _DropTokens.apply(x, dim)
