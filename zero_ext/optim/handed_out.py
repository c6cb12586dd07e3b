"""Which optimizer ``initialize`` hands out (``engine.optimizer``).

DeepSpeed wraps the base optimizer only where it has to: at ZeRO stage 0 over an fp32 model (fp32
gradients, no loss scale) its engine returns the base optimizer itself, the client's object or the one
its config section built. Scripts rely on that: they build a torch LR scheduler over it, check
``isinstance(optimizer, torch.optim.AdamW)``, or compare it with their own by identity. zero_ext does the
same; the ZeroOptimizer that reduces, clips and steps stays inside the engine (``engine.zero_optimizer``).

The base steps the flat fp32 buffer the parameters are views of (optim/flat_group.py), so its own
``zero_grad`` would clear only that buffer's ``.grad``, and the next step would see no gradient while
the parameters' ``.grad`` kept theirs. The handed-out instance's ``zero_grad`` is therefore the engine's
(the gradients dropped, ``.grad`` None, the step cycle back at its start), as DeepSpeed's base
``zero_grad`` clears the parameters' gradients there. And a script may step the base directly
(``engine.backward(loss); optimizer.step(); optimizer.zero_grad()``): DeepSpeed's backward has averaged
the gradients across ranks by then, zero_ext's step averages them, so a step pre-hook on the base averages
them first when the engine has not (the engine's own step has; without it each rank would step its own
gradients and the replicas drift apart). ``engine.destroy()`` removes both.
"""
import weakref

import torch

_PRE_STEP = weakref.WeakKeyDictionary()  # handed-out base -> its step pre-hook's handle


def hands_out_base(zopt) -> bool:
    """Whether DeepSpeed would hand out ``zopt``'s base optimizer: stage 0, every group fp32 in the
    model, the master and the accumulation (so no 16-bit wrapper), no loss scale, no offload."""
    return (zopt.stage == 0 and bool(zopt.flat_groups) and zopt.loss_scaler.cur_scale == 1.0
            and not zopt.loss_scaler.dynamic
            and all(g.dtype == g.master_dtype == torch.float32 and g.acc_grad is None and not g.offloaded
                    for g in zopt.flat_groups))


def hand_out(engine) -> torch.optim.Optimizer:
    """The base optimizer, its ``zero_grad`` made the engine's (see the module's note)."""
    base, ref = engine.zero_optimizer.optimizer, weakref.ref(engine)

    def zero_grad(set_to_none: bool = True) -> None:
        live = ref()
        if live is not None:
            live.zero_grad(set_to_none)

    def average_first(_optimizer, _args, _kwargs) -> None:
        live = ref()
        if live is not None and not live.zero_optimizer.reduced:  # (the engine's step has reduced already)
            live.gradients("optimizer.step() (the base optimizer, stepped directly)")

    zero_grad.__doc__ = "The engine's zero_grad (zero_ext.optim.handed_out): drops the gradients of this step."
    base.zero_grad = zero_grad
    _PRE_STEP[base] = base.register_step_pre_hook(average_first)
    return base


def take_back(base: torch.optim.Optimizer) -> None:
    """engine.destroy(): the base's own zero_grad again, and no step pre-hook."""
    base.__dict__.pop("zero_grad", None)
    handle = _PRE_STEP.pop(base, None)
    if handle is not None:
        handle.remove()
