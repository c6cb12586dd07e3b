"""FusedAdam: DeepSpeed's ``deepspeed.ops.adam.FusedAdam``, Adam/AdamW over all of a param group's
tensors in one kernel call, wherever they live:

- host tensors: zero_ext's C kernel (csrc/cpu_adam.c), as CPUAdam steps them (DeepSpeed's CPU accelerator
  builds its FusedAdam from its C++ CPU Adam too);
- accelerator tensors: torch's fused Adam(W) kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``),
  one launch per dtype and step count, fp32 math rounded once, as DeepSpeed's multi-tensor CUDA kernel.
  Where that kernel cannot run (``bias_correction=False``, a state kept in another dtype than its
  parameter, a device torch has no fused kernel for) the update is device_math.py's torch operations,
  the same formula.

So a config ``Adam``/``AdamW`` section without offload and without ``torch_adam`` builds it, as DeepSpeed
does (with optimizer offload: CPUAdam, DeepSpeed's DeepSpeedCPUAdam). Constructor, state keys ("step",
"exp_avg", "exp_avg_sq") and the ``adam_w_mode`` / ``set_grad_none`` attributes are DeepSpeed's; the state
is kept in the parameter's dtype, as DeepSpeed's FusedAdam and torch's Adam keep it.
"""
import functools

import torch

from .adam import CPUAdam

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _fused_devices():
    """Device types torch has fused Adam kernels for (its private helper; CUDA where it is missing)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:
        return ("cuda",)


class FusedAdam(CPUAdam):
    """Adam / AdamW with DeepSpeed's FusedAdam interface (see the module's note). ``adam_w_mode`` True
    decays weights decoupled (AdamW), False adds the L2 term to the gradient (Adam)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0., amsgrad=False, set_grad_none=True, fp32_optimizer_states=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (as DeepSpeed's); use "
                               "torch.optim.Adam(amsgrad=True) instead")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                         weight_decay=weight_decay, adamw_mode=bool(adam_w_mode),
                         fp32_optimizer_states=fp32_optimizer_states)
        self.adam_w_mode = 1 if adam_w_mode else 0  # DeepSpeed's attribute (an int there)
        self.set_grad_none = set_grad_none
        self.device_params = True  # accelerator tensors are stepped, not refused

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _device_step(self, group, items, grad_scale):
        """torch's fused kernel over the accelerator parameters of ``group``: one call per (device, dtype,
        step number); the rest through device_math (CPUOptimizer._device_step)."""
        fused, other = {}, []
        for item in items:
            if self._fusable(group, *item[:2]):
                p, _, step, _ = item
                fused.setdefault((p.device, p.dtype, step), []).append(item)
            else:
                other.append(item)
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if group.get("adamw_mode", self.adam_w_mode) else torch._fused_adam_
        for (device, _, step), batch in fused.items():
            params = [p for p, *_ in batch]
            grads = [p.grad for p in params]
            if grad_scale != 1.0:  # (torch's grad_scale argument divides; ours multiplies)
                grads = torch._foreach_mul(grads, grad_scale)
            steps = [torch.full((), float(step), dtype=torch.float32, device=device) for _ in params]
            kernel(params, grads, [s["exp_avg"] for _, s, *_ in batch], [s["exp_avg_sq"] for _, s, *_ in batch],
                   [], steps, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                   weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), amsgrad=False,
                   maximize=False)
            for p, _, _, out in batch:
                if out is not None:
                    out.copy_(p.detach().reshape(out.shape))
        if other:
            super()._device_step(group, other, grad_scale)

    @staticmethod
    def _fusable(group, p, state) -> bool:
        grad = p.grad
        return (group.get("bias_correction", True) and p.device.type in _fused_devices()
                and p.dtype in _FUSED_DTYPES and not grad.is_sparse and grad.dtype == p.dtype
                and grad.device == p.device
                and all(state[k].dtype == p.dtype and state[k].device == p.device for k in ("exp_avg", "exp_avg_sq")))
