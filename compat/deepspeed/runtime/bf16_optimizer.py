"""``deepspeed.runtime.bf16_optimizer``: BF16_Optimizer for isinstance checks.

DeepSpeed builds its BF16_Optimizer for bf16 at ZeRO stage 1 with ``data_types.grad_accum_dtype`` fp32
and no optimizer offload; zero_ext's ZeroOptimizer runs that case too (a full fp32 accumulation buffer
per group, ``FlatGroup.acc_grad``), so isinstance answers for it."""
from zero_ext.optim.zero_optimizer import ZeroOptimizer as _ZeroOptimizer


def is_bf16_optimizer(obj) -> bool:
    """Whether DeepSpeed would have built its BF16_Optimizer where zero_ext built ``obj``."""
    return (isinstance(obj, _ZeroOptimizer) and obj.stage == 1 and bool(obj.flat_groups)
            and all(g.acc_grad is not None and not g.offloaded for g in obj.flat_groups))


class _AccumulatesInFp32(type):

    def __instancecheck__(cls, obj):
        return is_bf16_optimizer(obj)


class BF16_Optimizer(metaclass=_AccumulatesInFp32):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's bf16 optimizer class, for isinstance checks only (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        raise TypeError("BF16_Optimizer is built by deepspeed.initialize (zero_ext's ZeroOptimizer: bf16, ZeRO stage "
                        "1, data_types.grad_accum_dtype fp32); it is here for isinstance checks only")
