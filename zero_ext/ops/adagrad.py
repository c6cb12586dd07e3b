"""CPUAdagrad: DeepSpeed's DeepSpeedCPUAdagrad over zero_ext's C kernel (csrc/cpu_optim_adagrad.c).

state[p]: "step" (int) and "exp_avg_sq" (the running sum of squared gradients, DeepSpeed's name for
torch.optim.Adagrad's "sum"). Results are torch.optim.Adagrad's with lr_decay=0 and
initial_accumulator_value=0, up to torch's own sqrt rounding. Sparse gradients are not supported.
"""
from .. import _C
from . import device_math
from ._optimizer import CPUOptimizer, _validate


class CPUAdagrad(CPUOptimizer):
    """Adagrad on CPU tensors, DeepSpeedCPUAdagrad's interface (amsgrad is accepted and ignored,
    as DeepSpeed does)."""

    state_keys = ("exp_avg_sq",)

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        _validate(lr=lr, eps=eps, weight_decay=weight_decay)
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        super().__init__(model_params, defaults, fp32_optimizer_states)

    def _kernel(self, group, step, batch, grad_scale):
        _C.adagrad_step(batch.params, batch.grads, batch.states["exp_avg_sq"], batch.outs_arg(), batch.numels,
                        batch.out_code(), float(group["lr"]), float(group["eps"]), float(group["weight_decay"]),
                        grad_scale)

    def _device_update(self, group, step, p, grad, state, grad_scale):
        device_math.adagrad_(p.data, grad, state["exp_avg_sq"], lr=float(group["lr"]), eps=float(group["eps"]),
                             weight_decay=float(group["weight_decay"]), grad_scale=grad_scale)


DeepSpeedCPUAdagrad = CPUAdagrad

__all__ = ["CPUAdagrad", "DeepSpeedCPUAdagrad"]
