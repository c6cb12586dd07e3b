"""The CPU optimizers' updates written with torch operations, for tensors on an accelerator.

ZeRO-Offload with ``offload_optimizer.ratio`` < 1 steps part of the sub-groups on the device; they
keep their state in the same optimizer (one state dict, one checkpoint), so the C optimizers hand
those tensors to these functions. Each is the formula its C kernel documents (csrc/cpu_adam.c,
cpu_optim_adagrad.c, cpu_optim_lion.c), one torch operation per step of it; on a GPU torch's
kernels round sqrt/division/FMA their own way, so results agree with the C kernel within a few ulp
rather than bit for bit (tests/test_offload_engine.py states the bound).
"""
import math

import torch


@torch.no_grad()
def adam_(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step, bias_correction, adamw_mode, grad_scale):
    g = g * grad_scale if grad_scale != 1.0 else g
    if weight_decay != 0.0:
        if adamw_mode:
            p.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)


@torch.no_grad()
def adagrad_(p, g, s, *, lr, eps, weight_decay, grad_scale):
    g = g * grad_scale if grad_scale != 1.0 else g
    if weight_decay != 0.0:
        g = g.add(p, alpha=weight_decay)
    s.addcmul_(g, g, value=1.0)
    p.addcdiv_(g, s.sqrt().add_(eps), value=-lr)


@torch.no_grad()
def lion_(p, g, m, *, lr, beta1, beta2, weight_decay, grad_scale):
    g = g * grad_scale if grad_scale != 1.0 else g
    p.mul_(1.0 - lr * weight_decay)
    c = torch.lerp(m, g, 1.0 - beta1)
    p.add_(c.sign_(), alpha=-lr)
    m.lerp_(g, 1.0 - beta2)
