"""DeepSpeed's ZeRO-3 linear function (``deepspeed.runtime.zero.linear``): ``zero3_linear_wrap(input,
weight, bias=None)`` computes ``F.linear`` through ``LinearFunctionForZeroStage3``, an autograd Function
that saves only its inputs and recomputes nothing.

zero_ext's ZeRO-3 does not need it: its hooks gather a parameter again before any backward that uses it,
whatever autograd saved (zero/hooks.py), so plain ``F.linear`` is what its models run. It is here for
code that calls DeepSpeed's function by name. As DeepSpeed's: it works under ``torch.func`` transforms
(``setup_context`` and a generated vmap rule), and its backward runs under the autocast state its
forward had, not the caller's (kept on the node under DeepSpeed's names, ``_fwd_used_autocast`` /
``_dtype``, which its tests read).

Also ``LinearModuleForZeroStage3`` (a Linear computed by it) and ``autocast_custom_fwd`` /
``autocast_custom_bwd`` (torch.amp.custom_fwd / custom_bwd bound to the accelerator's device type).
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

def _autocast_state(device_type: str):
    if torch.is_autocast_enabled(device_type):
        return True, torch.get_autocast_dtype(device_type)
    return False, None


class LinearFunctionForZeroStage3(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(input, weight, bias=None):
        # (inside forward the caller's autocast still applies: F.linear runs in its dtype)
        return torch.nn.functional.linear(input, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias = (tuple(inputs) + (None,))[:3]
        ctx.save_for_backward(input, weight, bias)
        ctx.device_type = input.device.type
        ctx._fwd_used_autocast, ctx._dtype = _autocast_state(ctx.device_type)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        with torch.autocast(ctx.device_type, dtype=ctx._dtype, enabled=ctx._fwd_used_autocast):
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight.to(grad_output.dtype))
            if ctx.needs_input_grad[1]:
                go = grad_output.reshape(-1, grad_output.shape[-1])
                grad_weight = go.t().matmul(input.reshape(-1, input.shape[-1]).to(go.dtype))
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input, weight, bias=None):
    """``F.linear(input, weight, bias)`` through LinearFunctionForZeroStage3."""
    if bias is None:
        return LinearFunctionForZeroStage3.apply(input, weight)
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(torch.nn.Linear):
    """torch.nn.Linear computed by LinearFunctionForZeroStage3."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return LinearFunctionForZeroStage3.apply(input, self.weight, self.bias)


__all__ = ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "autocast_custom_bwd", "autocast_custom_fwd",
           "noop_decorator", "zero3_linear_wrap"]
