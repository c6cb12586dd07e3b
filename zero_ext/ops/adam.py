"""CPUAdam: DeepSpeed's DeepSpeedCPUAdam over zero_ext's C kernel (csrc/cpu_adam.c).

Same constructor, same state (state[p]: "step" int, "exp_avg", "exp_avg_sq"), same results as
torch.optim.Adam/AdamW up to torch's own sqrt rounding. Unlike DeepSpeed's op it needs no
JIT build, picks AVX-512/AVX2/scalar at run time, steps all of a param group's tensors in one C
call with the GIL released, and can unscale/clip gradients and write bf16/fp16 copies of the new
parameters in the same pass (step(grad_scale=..., fp16_param_groups=...)).
"""
from .. import _C
from . import device_math
from ._optimizer import CPUOptimizer, _validate


class CPUAdam(CPUOptimizer):
    """Adam/AdamW on CPU tensors, DeepSpeedCPUAdam's interface.

    Arguments as DeepSpeedCPUAdam: lr, bias_correction, betas, eps, weight_decay, amsgrad (not
    supported: True raises), adamw_mode (True: decoupled weight decay, AdamW; False: L2 added to the
    gradient, Adam), fp32_optimizer_states (False keeps exp_avg/exp_avg_sq in the param dtype).
    A param group may override "adamw_mode" and "bias_correction".
    """

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        _validate(lr=lr, eps=eps, betas=betas, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        amsgrad=amsgrad)
        self.adam_w_mode = adamw_mode  # DeepSpeed's attribute name
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def add_param_group(self, param_group):
        if param_group.get("amsgrad", self.defaults["amsgrad"]):
            raise RuntimeError("CPUAdam does not support the AMSGrad variant (nor does DeepSpeedCPUAdam); "
                               "use torch.optim.Adam(amsgrad=True) instead")
        super().add_param_group(param_group)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("bias_correction", True)

    def _kernel(self, group, step, batch, grad_scale):
        beta1, beta2 = group["betas"]
        _C.adam_step(batch.params, batch.grads, batch.states["exp_avg"], batch.states["exp_avg_sq"],
                     batch.outs_arg(), batch.numels, batch.out_code(), float(group["lr"]), float(beta1),
                     float(beta2), float(group["eps"]), float(group["weight_decay"]), step,
                     bool(group.get("bias_correction", True)), bool(group.get("adamw_mode", self.adam_w_mode)),
                     grad_scale)

    def _device_update(self, group, step, p, grad, state, grad_scale):
        beta1, beta2 = group["betas"]
        device_math.adam_(p.data, grad, state["exp_avg"], state["exp_avg_sq"], lr=float(group["lr"]), beta1=beta1,
                          beta2=beta2, eps=float(group["eps"]), weight_decay=float(group["weight_decay"]), step=step,
                          bias_correction=bool(group.get("bias_correction", True)),
                          adamw_mode=bool(group.get("adamw_mode", self.adam_w_mode)), grad_scale=grad_scale)


DeepSpeedCPUAdam = CPUAdam

__all__ = ["CPUAdam", "DeepSpeedCPUAdam"]
