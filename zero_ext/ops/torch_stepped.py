"""TorchStepped: a torch.optim optimizer (``torch_adam: true``'s Adam/AdamW) behind the CPU optimizers'
interface, for NVMe optimizer offload.

The NVMe store streams each group's fp32 master and state tensors through host buffers and hands them to
the optimizer one resident group (or sub-group slice) at a time: ``step(params=[...])`` and
``step_slice(...)`` on tensors that are not the optimizer's own parameters. torch's optimizers step only
their parameters, with their state; so each update here points one private parameter at the tensors
given, installs their state, and runs the torch optimizer's own ``step()``: the arithmetic is torch's,
unchanged (the same results as torch.optim.AdamW stepping the master in memory).
"""
from typing import Dict, Optional

import torch

from ._optimizer import CPUOptimizer, _step_int

# the hyper-parameters copied from our param group into the torch optimizer's before each update
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


class TorchStepped(CPUOptimizer):
    """``base``'s updates (a torch.optim.Adam or AdamW) on the tensors the NVMe store brings in.

    Takes over ``base``'s param groups (the same dicts: a scheduler built on ``base`` still sets the lr
    used here); state per parameter: "step" (int), "exp_avg", "exp_avg_sq" (+ "max_exp_avg_sq" with
    amsgrad), fp32, as torch's.
    """

    def __init__(self, base: torch.optim.Optimizer):
        if type(base) not in (torch.optim.Adam, torch.optim.AdamW):
            raise TypeError(f"TorchStepped steps torch.optim.Adam/AdamW, not {type(base).__name__}")
        if base.state:
            raise ValueError("TorchStepped: the optimizer already has state; wrap a fresh one")
        amsgrad = any(g.get("amsgrad") for g in base.param_groups)
        self.state_keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        super().__init__([{"params": []}], dict(base.defaults))
        self.param_groups = base.param_groups  # (shared: lr changes reach both)
        self.base_class = type(base)
        self._proxy = torch.nn.Parameter(torch.zeros(0))
        kwargs = {k: base.defaults[k] for k in _HYPER if k in base.defaults}
        # the single-tensor implementation: foreach/fused would only batch this one tensor anyway
        self._inner = type(base)([self._proxy], foreach=False, **kwargs)

    def _update(self, group: dict, param: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor],
                step: int, out: Optional[torch.Tensor], grad_scale: float) -> None:
        proxy, inner = self._proxy, self._inner
        proxy.data = param.detach()
        proxy.grad = grad * grad_scale if grad_scale != 1.0 else grad.detach()
        inner_group = inner.param_groups[0]
        for k in _HYPER:
            if k in group:
                inner_group[k] = group[k]
        # torch counts its step in a float tensor and increments it before the update
        inner.state[proxy] = {"step": torch.tensor(float(step - 1)), **{k: state[k] for k in self.state_keys}}
        try:
            inner.step()
        finally:
            inner.state.pop(proxy, None)
            proxy.grad, proxy.data = None, torch.zeros(0)
        if out is not None:
            out.copy_(param.detach().reshape(out.shape))

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None, *, grad_scale=1.0, params=None):
        """As CPUOptimizer.step, with torch's update for each parameter that has a gradient."""
        loss, outs, only = self._prepare_step(closure, fp16_param_groups, params)
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None or (only is not None and id(p) not in only):
                    continue
                self._check_device(p)
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(p, state)
                state["step"] = _step_int(state["step"]) + 1
                out = outs[gi][pi] if outs is not None else None
                self._update(group, p, p.grad, state, state["step"], out, float(grad_scale))
        return loss

    @torch.no_grad()
    def step_slice(self, group: dict, param, grad, state: dict, step: int, out=None, grad_scale: float = 1.0):
        self._update(group, param, grad, state, step, out, float(grad_scale))
