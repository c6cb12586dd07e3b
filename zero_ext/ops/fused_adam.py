"""FusedAdam: DeepSpeed's ``deepspeed.ops.adam.FusedAdam`` (its multi-tensor Adam/AdamW for accelerator
tensors), as torch's own multi-tensor Adam.

Same constructor and state keys ("step", "exp_avg", "exp_avg_sq") as DeepSpeed's; torch picks its
multi-tensor (foreach) or fused kernel for the parameters' device, on CPU tensors too (as DeepSpeed's CPU
accelerator builds its FusedAdam there). ``adam_w_mode`` True decays weights decoupled (AdamW: the
parameter is scaled by ``1 - lr * weight_decay`` before the update, as torch's AdamW does), False adds the
L2 term to the gradient (Adam). What torch's Adam cannot do is refused: ``amsgrad`` (DeepSpeed refuses it
too) and ``bias_correction=False``.
"""
import torch


class FusedAdam(torch.optim.Adam):
    """Adam / AdamW with DeepSpeed's FusedAdam interface (see the module's note)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0., amsgrad=False, set_grad_none=True):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (as DeepSpeed's)")
        if not bias_correction:
            raise NotImplementedError("FusedAdam(bias_correction=False): zero_ext's FusedAdam is torch's Adam, which "
                                      "always corrects bias; use zero_ext.ops.adam.CPUAdam (DeepSpeedCPUAdam), which "
                                      "takes it, on CPU tensors")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.adam_w_mode = 1 if adam_w_mode else 0  # DeepSpeed's attribute (an int there)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        if not self.adam_w_mode:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        decays = [group["weight_decay"] for group in self.param_groups]
        try:
            for group, decay in zip(self.param_groups, decays):
                params = [p for p in group["params"] if p.grad is not None]
                if decay and params:  # decoupled: scale first, then Adam without the L2 term
                    torch._foreach_mul_(params, 1.0 - group["lr"] * decay)
                group["weight_decay"] = 0.0
            super().step()
        finally:
            for group, decay in zip(self.param_groups, decays):
                group["weight_decay"] = decay
        return loss
