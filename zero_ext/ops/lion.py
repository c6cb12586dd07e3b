"""CPULion: DeepSpeed's DeepSpeedCPULion over zero_ext's C kernel (csrc/cpu_optim_lion.c).

state[p]: "step" (int) and "exp_avg". The update is the published Lion with torch's sign (0 for 0
and NaN): p = p*(1 - lr*wd) - lr*sign(lerp(m, g, 1-beta1)); m = lerp(m, g, 1-beta2). DeepSpeed's
CPU kernel differs only where the interpolation is exactly 0 (it moves such a parameter by lr) or
NaN, and it also allocates an unused "exp_avg_sq", which this class does not.
"""
from .. import _C
from . import device_math
from ._optimizer import CPUOptimizer, _validate


class CPULion(CPUOptimizer):
    """Lion on CPU tensors, DeepSpeedCPULion's interface."""

    state_keys = ("exp_avg",)

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        _validate(lr=lr, betas=betas, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def _kernel(self, group, step, batch, grad_scale):
        beta1, beta2 = group["betas"]
        _C.lion_step(batch.params, batch.grads, batch.states["exp_avg"], batch.outs_arg(), batch.numels,
                     batch.out_code(), float(group["lr"]), float(beta1), float(beta2), float(group["weight_decay"]),
                     grad_scale)

    def _device_update(self, group, step, p, grad, state, grad_scale):
        beta1, beta2 = group["betas"]
        device_math.lion_(p.data, grad, state["exp_avg"], lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                          weight_decay=float(group["weight_decay"]), grad_scale=grad_scale)


DeepSpeedCPULion = CPULion

__all__ = ["CPULion", "DeepSpeedCPULion"]
