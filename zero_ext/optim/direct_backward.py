"""``loss.backward()`` called directly on an engine's output (DeepSpeed's "torch-style backward"), and
``engine.scale(loss)``.

``engine.backward(loss)`` divides the loss by the accumulation steps, multiplies it by the fp16 loss
scale and counts the micro step. A script (or a library: several engines with one combined loss, a
non-scalar ``out.backward(grad)``) may call autograd itself instead. For that the engine marks the
tensors its forward returns (``watch``): a gradient flowing back through one of them is divided by the
accumulation steps there, and the end of that backward is counted as ``engine.backward`` counts it,
so the step after it applies the same gradients. The fp16 loss scale cannot be applied that way (the
overflow check reads scaled gradients): with fp16 the loss must go through ``engine.scale(loss)`` first,
and a direct backward without it raises at its end, before the step could use unscaled gradients.

Under torch.func transforms (grad, vmap, ...) the marks do nothing: those backward passes belong to the
transform, not to training. Gradients that do not flow through a forward output of the engine are not
seen here; the step then refuses them as before (engine.py). Where we differ from DeepSpeed: ZeRO stage
0 accepts a direct backward too (DeepSpeed refuses it there, lacking the hooks its other stages use).
"""
import contextlib
import warnings

import torch

from .. import comm
from ..config.errors import EngineUsageError


def _functorch_transforming() -> bool:
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _tensors(out, found=None):
    """The tensors with a grad_fn inside a forward's output (tensors, sequences, mappings, dataclasses)."""
    found = [] if found is None else found
    if isinstance(out, torch.Tensor):
        if out.grad_fn is not None:
            found.append(out)
    elif isinstance(out, (list, tuple)):
        for item in out:
            _tensors(item, found)
    elif isinstance(out, dict):  # (transformers' ModelOutput is a dict too)
        for item in out.values():
            _tensors(item, found)
    return found


def _assigned(g) -> bool:
    """Whether a parameter of group ``g`` has a ``.grad`` other than the engine's own: at stages 0/1 each
    parameter's ``.grad`` is its view of the group's flat ``lp_grad``; at stages 2/3 there is none."""
    lp = getattr(g, "lp_grad", None)
    if lp is None:
        return any(p.grad is not None for p in g.params)
    ptr, size = lp.data_ptr(), lp.element_size()
    return any(p.grad is not None and p.grad.data_ptr() != ptr + off * size for p, off in zip(g.params, g.offsets))


class DirectBackward:
    """One engine's bookkeeping for backward passes it did not start (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.in_engine_backward = False  # engine.backward() is running: it scales and counts itself
        self.scaled = False  # engine.scale() was called since the last direct backward
        self.pending = False  # a direct backward is running; its end is queued

    def watch(self, out) -> None:
        """Marks the tensors of a forward's output (only when a backward can follow)."""
        if not torch.is_grad_enabled() or _functorch_transforming():
            return
        for t in _tensors(out):
            t.register_hook(self._on_grad)

    @contextlib.contextmanager
    def engine_backward(self):
        self.in_engine_backward = True
        try:
            yield
        finally:
            self.in_engine_backward = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the loss scale (fp16; 1 otherwise), for ``engine.scale(loss).backward()``."""
        self.engine._require_optimizer("scale")
        if not torch.is_tensor(loss) or loss.numel() != 1 or loss.grad_fn is None:
            raise EngineUsageError("engine.scale(loss): loss must be a scalar tensor with a grad_fn (for a "
                                   "non-scalar output call out.backward(grad) directly)")
        self.scaled = True
        scale = self.engine.zero_optimizer.cur_scale
        return loss * scale if scale != 1.0 else loss

    def _on_grad(self, grad):
        if self.in_engine_backward or _functorch_transforming():
            return grad
        if not self.pending:
            self.engine._require_optimizer("backward")  # (raises out of loss.backward())
            self.pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        gas = self.engine.gradient_accumulation_steps()
        return grad / gas if gas > 1 and grad is not None else grad

    def _finish(self) -> None:
        self.pending = False
        self.count("loss.backward()")

    def count(self, what: str, unscaled_is_error: bool = True) -> None:
        """Counts a backward the engine did not run, as engine.backward counts its own; also DeepSpeed's
        ``engine._backward_epilogue()``, which scripts call after a backward through ``engine.module``
        (several engines, one loss: DeepSpeed's test_multiple_models), where no output was watched. That
        one, as in DeepSpeed, runs on an unscaled fp16 loss too: a warning says what the step will do."""
        self.engine._require_optimizer("backward")
        scaled, self.scaled = self.scaled, False
        if self.engine.zero_optimizer.needs_scaler() and not scaled:
            problem = f"Loss scaling is required (fp16), but {what} counts a backward of an unscaled loss"
            fix = "call engine.scale(loss).backward() or engine.backward(loss)"
            if unscaled_is_error:
                raise EngineUsageError(f"{problem}: {fix}")
            warnings.warn(f"{problem} (unless it was scaled by hand): the step divides these gradients by the loss "
                          f"scale ({self.engine.zero_optimizer.cur_scale:g}); {fix}", RuntimeWarning, stacklevel=3)
        self.engine._advance("backward", what)

    def take_hand_set_gradients(self) -> bool:
        """step() without a counted backward, where the script assigned the parameters' ``.grad`` itself
        (``p.grad = tensor``, as torch's optimizers and DeepSpeed's stage-0 optimizers allow; DeepSpeed's
        test_dynamic_loss_scale steps that way). Stages 0/1 keep the parameters' gradients in one flat
        buffer that the boundary reduces and collects assigned tensors into, so there they are this step's
        gradients: averaged across the ranks and, in fp16, taken as scaled by the loss scale, as a
        backward's would be. Stages 2/3 reduce inside backward and never read ``.grad``: assigned ones
        would be dropped without a word, so they raise. Collective, like the step: True when any rank has
        assigned gradients."""
        engine = self.engine
        groups = engine.zero_optimizer.flat_groups
        assigned = any(_assigned(g) for g in groups)
        if engine.world_size > 1:
            flag = torch.tensor([1.0 if assigned else 0.0], device=engine.device)
            comm.all_reduce(flag, op=comm.ReduceOp.MAX)
            assigned = bool(flag.item())
        if assigned and any(getattr(g, "lp_grad", None) is None for g in groups):
            raise EngineUsageError(f"engine.step(): parameters have .grad assigned by hand, but ZeRO stage "
                                   f"{engine.zero_optimizer.stage} reduces gradients during engine.backward() and never "
                                   "reads .grad, so they would be dropped. Compute them with engine.backward(loss), "
                                   "or use ZeRO stage 0 or 1, which take assigned gradients")
        return assigned

    def refuse_outside_gradients(self) -> None:
        """step() without a counted backward: an error if gradients are there anyway, i.e. the script ran
        autograd on a loss not computed through the engine's forward (unscaled for accumulation and fp16,
        and uncounted). Collective: every rank reaches this step() the same way, and all must agree to raise."""
        engine = self.engine
        if engine.phase.value == "accumulated":  # a backward ran earlier in this accumulation: its gradients
            return
        groups = engine.zero_optimizer.flat_groups
        found = any(t is not None and bool(t.any()) for g in groups for t in (getattr(g, "lp_grad", None), g.grad))
        if engine.world_size > 1:
            flag = torch.tensor([1.0 if found else 0.0], device=engine.device)  # (offloaded grads live on the host)
            comm.all_reduce(flag, op=comm.ReduceOp.MAX)
            found = bool(flag.item())
        if found:
            raise EngineUsageError("engine.step(): the parameters have gradients, but engine.backward() was not called "
                                   "since the last step: call engine.backward(loss) instead of loss.backward(). The "
                                   "engine scales the loss for gradient accumulation (and fp16) and counts the micro "
                                   "step there; gradients from a plain loss.backward() would be applied wrongly (it is "
                                   "counted only for a loss computed from the engine's own forward, engine(batch))")
