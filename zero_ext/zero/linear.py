"""DeepSpeed's ``deepspeed.runtime.zero.linear``: LinearModuleForZeroStage3, a Linear whose forward is an
autograd function that runs under the caller's autocast state in both passes (torch.amp.custom_fwd /
custom_bwd for the accelerator's device).

DeepSpeed's zero.Init swaps F.linear for it with ``memory_efficient_linear`` so that autograd saves no
gathered weight; zero_ext never swaps anything (its hooks free gathered weights after each forward either
way, docs/config.md), so this module is only for code that builds the class by name.
"""
import functools

import torch

from ..accelerator import get_accelerator


def noop_decorator(func):
    return func


def _autocast_decorators():
    """torch.amp.custom_fwd / custom_bwd bound to the accelerator's device type (torch >= 2.4), else
    the device module's legacy ones, else no-ops."""
    device_type = get_accelerator().device_name()
    amp = getattr(torch, "amp", None)
    fwd, bwd = getattr(amp, "custom_fwd", None), getattr(amp, "custom_bwd", None)
    if fwd is not None and bwd is not None:
        return functools.partial(fwd, device_type=device_type), functools.partial(bwd, device_type=device_type)
    legacy = getattr(getattr(torch, device_type, None), "amp", None)
    return (getattr(legacy, "custom_fwd", noop_decorator), getattr(legacy, "custom_bwd", noop_decorator))


autocast_custom_fwd, autocast_custom_bwd = _autocast_decorators()


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """y = x W^T + b, with the backward under the forward's autocast state."""

    @staticmethod
    @autocast_custom_fwd
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        out = input.matmul(weight.t())  # (under autocast: in its dtype; the bias joins in that dtype too)
        return out + bias.to(out.dtype) if bias is not None else out

    @staticmethod
    @autocast_custom_bwd
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight.to(grad_output.dtype))
        if ctx.needs_input_grad[1]:
            rows = grad_output.reshape(-1, grad_output.shape[-1])
            grad_weight = rows.t().matmul(input.reshape(-1, input.shape[-1]).to(rows.dtype)).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0).to(bias.dtype)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input, weight, bias=None):
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(torch.nn.Linear):
    """torch.nn.Linear computed by LinearFunctionForZeroStage3."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return LinearFunctionForZeroStage3.apply(input, self.weight, self.bias)
