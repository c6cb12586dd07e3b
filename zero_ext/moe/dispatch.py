"""Moving tokens into the experts' buffers and back, and between the ranks of an expert-parallel group.

The gate gives each route (token, choice) an expert and a slot; a route's flat slot in the ``[E, C, M]``
buffer is expert x C + slot, and dropped routes all point at one spare slot past the end, which is
filled and read like the others and then cut off (no branches, one scatter and one gather). The
buffer's expert rows are in global expert order, so rows [r L, (r + 1) L) (L local experts) are EP rank
r's: an all-to-all over the EP group sends each rank its experts' tokens from every rank, and the same
all-to-all on the experts' output sends them back. Its gradient is the same all-to-all of the gradient.
"""
from typing import Any, Tuple

import torch

from .. import comm


def _route_slots(indices: torch.Tensor, locations: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Flat buffer slots ([k, S], int64) of the routes; a dropped route (index < 0) gets the spare slot."""
    flat = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, flat, torch.full_like(flat, num_experts * capacity))


def _sparse_encode(tokens: torch.Tensor, slots: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The experts' input buffer [E, C, M]: each routed token copied to its slot, empty slots zero."""
    num_tokens, width = tokens.shape
    routes = slots.shape[0]
    buffer = tokens.new_zeros(num_experts * capacity + 1, width)
    copies = tokens.unsqueeze(0).expand(routes, num_tokens, width).reshape(routes * num_tokens, width)
    buffer = buffer.index_put((slots.reshape(-1),), copies)  # only the spare slot is written twice
    return buffer[:-1].view(num_experts, capacity, width)


def _sparse_decode(expert_output: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor,
                   num_tokens: int) -> torch.Tensor:
    """Each token's output [S, M]: the sum over its routes of the gate weight x its expert's output at
    its slot (``expert_output`` is the flat [E C, M] buffer). Summed in fp32 (the gates' type), returned
    in the experts' type."""
    width = expert_output.shape[-1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, width)])
    picked = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, width)
    return (picked * gates.unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over ``group`` (dim 0 cut in equal chunks, chunk d to rank d); differentiable."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        send = input.contiguous()
        received = torch.empty_like(send)
        comm.all_to_all_single(received, send, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.group, *grad_output)
