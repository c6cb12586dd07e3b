"""``deepspeed.runtime.bf16_optimizer``: BF16_Optimizer for isinstance checks.

DeepSpeed builds its BF16_Optimizer for bf16 at ZeRO stage 1 with ``data_types.grad_accum_dtype`` fp32
and no optimizer offload; zero_ext's ZeroOptimizer runs that case too (a full fp32 accumulation buffer
per group, ``FlatGroup.acc_grad``), so isinstance answers for it."""
from zero_ext.optim.zero_optimizer import ZeroOptimizer as _ZeroOptimizer

from ._isinstance_only import isinstance_only


def is_bf16_optimizer(obj) -> bool:
    """Whether DeepSpeed would have built its BF16_Optimizer where zero_ext built ``obj``."""
    return (isinstance(obj, _ZeroOptimizer) and obj.stage == 1 and bool(obj.flat_groups)
            and all(g.acc_grad is not None and not g.offloaded for g in obj.flat_groups))


BF16_Optimizer = isinstance_only(
    "BF16_Optimizer", __name__, "DeepSpeed's bf16 optimizer class, for isinstance checks only (see the module "
    "docstring).", is_bf16_optimizer,
    "BF16_Optimizer is built by deepspeed.initialize (zero_ext's ZeroOptimizer: bf16, ZeRO stage 1, "
    "data_types.grad_accum_dtype fp32); it is here for isinstance checks only")
