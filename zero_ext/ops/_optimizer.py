"""What CPUAdam, CPUAdagrad and CPULion share: a torch.optim.Optimizer whose step hands every
parameter of a param group to ONE C call (per step count), with state kept as DeepSpeed keeps it.

state[p] holds "step" (an int, as DeepSpeed stores it) and the optimizer's fp32 state tensors, so
state_dict()/load_state_dict() and zero_ext's state routines see ordinary tensors.

Parameters the kernels cannot take in place (bf16/fp16 params, states kept in the param dtype
with fp32_optimizer_states=False, non-contiguous tensors) go through fp32 working copies that are
written back after the call: slower, never wrong. fp32 contiguous parameters, the ZeRO case, go
straight to C with no copy.
"""
from itertools import chain

import torch

from ..offload.host_buffers import host_empty
from .._native.dtypes import kernel_dtype
from .functional import _sync_threads

_F32 = torch.float32
_HALF = (torch.bfloat16, torch.float16)


def _step_int(step):
    """state["step"] as an int: ours are ints, torch.optim's are 0-dim tensors."""
    return int(step.item()) if isinstance(step, torch.Tensor) else int(step)


def _work(t, name):
    """(fp32 contiguous tensor the kernel may write, whether it is a copy of t)."""
    if not t.is_cpu:
        raise RuntimeError(f"the {name} is on {t.device}; the zero_ext CPU optimizers keep parameters, "
                           "gradients and optimizer state on the CPU (move it with .cpu())")
    if t.dtype is _F32 and t.is_contiguous():
        return t, False
    return t.to(dtype=_F32, memory_format=torch.contiguous_format, copy=True), True


class _Batch:
    """The pointers of one C call, and the copies to write back after it."""

    __slots__ = ("keys", "params", "grads", "states", "outs", "numels", "out_dtype", "writeback", "copy_out")

    def __init__(self, keys):
        self.keys = keys
        self.params, self.grads, self.outs, self.numels = [], [], [], []
        self.states = {k: [] for k in keys}
        self.out_dtype = None
        self.writeback = []  # (original, fp32 working copy)
        self.copy_out = []  # (requested low-precision copy the kernel could not write, fp32 source)

    def add(self, p, grad, state, out):
        """Queues one parameter. The fast path (fp32 contiguous tensors, the ZeRO case) touches
        each tensor only for its checks and address: per-parameter overhead is what a step over
        hundreds of tensors pays in Python."""
        states = [state[k] for k in self.keys]
        if (p.dtype is _F32 and grad.dtype is _F32 and grad.is_cpu and p.is_contiguous() and grad.is_contiguous()
                and not grad.is_sparse and all(s.dtype is _F32 and s.is_cpu and s.is_contiguous() for s in states)):
            n = p.numel()
            if grad.numel() != n:
                raise ValueError(f"gradient has {grad.numel()} elements but its parameter has {n}")
            self.params.append(p.data_ptr())
            self.grads.append(grad.data_ptr())
            for k, s in zip(self.keys, states):
                self.states[k].append(s.data_ptr())
            self.numels.append(n)
            self.outs.append(0 if out is None else self._out(out, p, n))
            return
        self._add_copies(p, grad, state, out)

    def _add_copies(self, p, grad, state, out):
        """The slow path: fp32 contiguous working copies, written back by finish()."""
        work, copied = _work(p.detach(), "parameter")
        if copied:
            self.writeback.append((p.detach(), work))
        if grad.is_sparse:
            raise RuntimeError("the zero_ext CPU optimizers do not support sparse gradients; "
                               "densify the gradient (grad.to_dense()) before step()")
        g, _ = _work(grad.detach(), "gradient")
        n = work.numel()
        if g.numel() != n:
            raise ValueError(f"gradient has {g.numel()} elements but its parameter has {n}")
        self.params.append(work.data_ptr())
        self.grads.append(g.data_ptr())
        self.numels.append(n)
        for k in self.keys:
            s, copied = _work(state[k], f"state {k!r}")
            if copied:
                self.writeback.append((state[k], s))
            self.states[k].append(s.data_ptr())
        self.outs.append(0 if out is None else self._out(out, work, n))
        # keep the working tensors alive until the call: the lists hold only addresses
        self.writeback.append((None, (work, g)))

    def _out(self, out, work, n):
        if out.numel() != n:
            raise ValueError(f"fp16_param_groups entry has {out.numel()} elements, its parameter {n}")
        fusable = (out.device.type == "cpu" and out.dtype in _HALF and out.is_contiguous()
                   and self.out_dtype in (None, out.dtype))
        if not fusable:
            self.copy_out.append((out, work))
            return 0
        self.out_dtype = out.dtype
        return out.data_ptr()

    def out_code(self):
        return kernel_dtype(self.out_dtype or torch.bfloat16)

    def outs_arg(self):
        return self.outs if self.out_dtype is not None else None

    def finish(self):
        for dst, src in self.writeback:
            if dst is not None:
                dst.copy_(src)
        for dst, src in self.copy_out:
            dst.copy_(src)


class CPUOptimizer(torch.optim.Optimizer):
    """Base class: subclasses set `state_keys` and implement `_kernel(group, step, batch, grad_scale)`."""

    state_keys = ()

    def __init__(self, params, defaults, fp32_optimizer_states=True):
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states
        # the ZeRO engine sets this for offload_optimizer.ratio < 1: parameters on an accelerator are
        # then stepped with torch operations (device_math.py) instead of being refused
        self.device_params = False

    def _kernel(self, group, step, batch, grad_scale):
        raise NotImplementedError

    def _device_update(self, group, step, p, grad, state, grad_scale):
        """One parameter on an accelerator, with torch operations (see device_math.py)."""
        raise NotImplementedError(f"{type(self).__name__} cannot step parameters on {p.device}")

    def _init_state(self, p, state):
        state["step"] = 0
        dtype = _F32 if self.fp32_optimizer_states else p.dtype
        for k in self.state_keys:
            state[k] = _state_tensor(p, dtype).zero_()

    @staticmethod
    def _out_groups(fp16_param_groups, ngroups):
        """DeepSpeed's fp16_param_groups as a list (per param group) of lists (per param)."""
        if fp16_param_groups is None:
            return None
        if isinstance(fp16_param_groups, torch.Tensor):
            fp16_param_groups = [fp16_param_groups]
        groups = list(fp16_param_groups)
        if groups and all(g is None or isinstance(g, torch.Tensor) for g in groups):
            groups = [groups]  # one flat list: the only param group's
        if len(groups) != ngroups:
            raise ValueError(f"fp16_param_groups has {len(groups)} groups; the optimizer has {ngroups}")
        return [list(g) for g in groups]

    def _check_device(self, p):
        if not p.is_cpu:
            raise RuntimeError(f"{type(self).__name__} param is on {p.device} and must be 'cpu', make sure you "
                               "enabled 'offload_optimizer': 'cpu' in your ZeRO config (or move the model "
                               "to the CPU)")

    def _prepare_step(self, closure, fp16_param_groups, params):
        """What every step starts with: (the closure's loss, fp16_param_groups checked per group, the ids
        of ``params`` to step or None for all)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        only = None if params is None else {id(t) for t in params}
        return loss, self._out_groups(fp16_param_groups, len(self.param_groups)), only

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None, *, grad_scale=1.0, params=None):
        """One step of every parameter that has a gradient: one C call per param group (per step
        count, should parameters of a group have been stepped unequally).

        fp16_param_groups (as DeepSpeed's older API): per group, a list of bf16/fp16 tensors, one per
        parameter (or None), that receive the updated parameters in the same pass, rounded exactly
        as p.to(dtype). grad_scale (zero_ext): gradients are multiplied by it as they are loaded
        (1/loss_scale times the clip coefficient); they are not modified. params (zero_ext): step only
        these parameters (the NVMe-offloaded step updates one resident group at a time).
        """
        loss, outs, only = self._prepare_step(closure, fp16_param_groups, params)
        _sync_threads()
        for gi, group in enumerate(self.param_groups):
            batches = {}
            group_outs = outs[gi] if outs is not None else None
            if group_outs is not None and len(group_outs) != len(group["params"]):
                raise ValueError(f"fp16_param_groups[{gi}] has {len(group_outs)} tensors for "
                                 f"{len(group['params'])} parameters")
            on_device = []
            for pi, p in enumerate(group["params"]):
                if p.grad is None or (only is not None and id(p) not in only):
                    continue
                if not (self.device_params and not p.is_cpu):
                    self._check_device(p)
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(p, state)
                step = _step_int(state["step"]) + 1
                state["step"] = step
                if not p.is_cpu:
                    on_device.append((p, state, step, group_outs[pi] if group_outs is not None else None))
                    continue
                batch = batches.get(step)
                if batch is None:
                    batch = batches[step] = _Batch(self.state_keys)
                batch.add(p, p.grad, state, group_outs[pi] if group_outs is not None else None)
            for step, batch in batches.items():
                self._kernel(group, step, batch, float(grad_scale))
                batch.finish()
            if on_device:
                self._device_step(group, on_device, float(grad_scale))
        return loss

    def _device_step(self, group, items, grad_scale):
        """The parameters of ``group`` on an accelerator, ``items``: (param, state, step number, bf16/fp16
        copy to write or None) each, one at a time with torch operations (device_math.py)."""
        for p, state, step, out in items:
            self._device_update(group, step, p, p.grad, state, grad_scale)
            if out is not None:
                out.copy_(p.detach().reshape(out.shape))

    @torch.no_grad()
    def step_slice(self, group: dict, param, grad, state: dict, step: int, out=None, grad_scale: float = 1.0):
        """The update step() makes of a parameter of param group ``group`` at step number ``step``, on
        the tensors given (``state``: one per ``state_keys``) and counting nothing: zero_ext's NVMe
        offload steps a stage-1/2 partition one sub-group slice at a time, as its state streams in."""
        _sync_threads()
        batch = _Batch(self.state_keys)
        batch.add(param, grad, state, out)
        self._kernel(group, step, batch, float(grad_scale))
        batch.finish()

    def load_state_dict(self, state_dict):
        """torch's load_state_dict, keeping fp32 states fp32: torch casts every loaded state tensor
        to its parameter's dtype, which would round the fp32 states of bf16/fp16 parameters."""
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(ids, params):
            if pid not in saved or p not in self.state:
                continue
            state = self.state[p]
            for k in self.state_keys:
                t = saved[pid].get(k)
                if isinstance(t, torch.Tensor):
                    want = _F32 if self.fp32_optimizer_states else p.dtype
                    state[k] = _state_tensor(p, want).copy_(t.reshape(p.shape))
            if "step" in state:
                state["step"] = _step_int(state["step"])


def _state_tensor(p, dtype) -> torch.Tensor:
    """An uninitialised state tensor shaped like p, on p's device; for a CPU parameter from
    host_buffers.host_empty (huge pages from 2 MiB up, on its own cache colour)."""
    if p.device.type == "cpu":
        return host_empty(tuple(p.shape), dtype)
    return torch.empty(p.shape, dtype=dtype, device=p.device)


def _validate(lr=None, eps=None, betas=None, weight_decay=None):
    if lr is not None and not 0.0 <= float(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps is not None and not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if betas is not None:
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    if weight_decay is not None and not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")

