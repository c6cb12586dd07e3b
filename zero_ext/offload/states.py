"""engine.offload_states() / reload_states(): park training state in host memory between phases.

    engine.offload_states()        # e.g. before evaluation or generation that needs the device memory
    ...
    engine.reload_states()         # back, bit for bit; training goes on as if nothing happened

Kinds (``OffloadStateTypeEnum``, DeepSpeed's names), for stages 0-3:
- ``optim_states``: the base optimizer's state tensors (Adam's moments);
- ``hp_params``: the fp32 master partitions — when the model is fp32 they *are* the parameters'
  partition (no copy exists), so this kind moves nothing and ``lp_params`` carries them;
- ``lp_params``: the model's parameters (the flat buffers their ``.data`` are views of, and the
  frozen parameters);
- ``lp_grads``: the gradient buffers (stages 0/1: the flat buffer ``.grad`` are views of; every stage:
  the fp32 gradient partitions);
- ``contiguous_grad_buffer``: stage 2's bucket buffers — freed, not copied (they hold nothing between
  steps) and allocated again at the next backward; stage 3 keeps none between steps.
At stage 3, ``lp_params`` are this rank's pieces: every gathered parameter (persistent ones too) is
released first, and ``reload_states`` gathers the persistent ones again.
Tensors keep their identity (their ``.data`` is moved), so optimizer state keys and user references
stay valid. On a CPU-only machine the compute device is the CPU: the engine still records the
placement, and ``memory_breakdown()`` reports the offloaded kinds under the host tier. ``step()`` or a
forward while states are offloaded is an error, not silent corruption.
"""
from enum import Enum
from typing import Iterable, Optional, Set

import torch


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def _move(t: torch.Tensor, device, pin: bool, non_blocking: bool) -> None:
    """Moves t's data to device, keeping the tensor object (and so every reference to it). To the host
    the copy lands straight in a pinned tensor (a copy issued non_blocking into pageable memory, then
    pinned, would read it before the copy finished)."""
    if t.device == torch.device(device):
        return
    if torch.device(device).type == "cpu":
        new = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin and torch.cuda.is_available())
        new.copy_(t.data, non_blocking=non_blocking and new.is_pinned())
    else:
        new = t.data.to(device, non_blocking=non_blocking)
    t.data = new


def _settle(non_blocking: bool) -> None:
    """Copies issued non_blocking finish before the call returns: the host reads the offloaded tensors,
    and the sources of reloads (freed with the old data) must not be reused mid-copy."""
    if non_blocking and torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def _kind_tensors(engine, kind: OffloadStateTypeEnum):
    """The tensors of one kind, as (tensor, views-to-repoint) pairs."""
    opt = engine.zero_optimizer
    out = []
    for g in opt.flat_groups:
        aliased = g.master.data_ptr() == g.flat[g.lo:g.hi].data_ptr()
        if kind == OffloadStateTypeEnum.lp_params:
            out.append(g.flat)  # stage 3: the pieces, which are views of it
        elif kind == OffloadStateTypeEnum.hp_params and not aliased:
            out.append(g.master)
        elif kind == OffloadStateTypeEnum.lp_grads:
            if g.lp_grad is not None:
                out.append(g.lp_grad)
            if g.grad is not None and (g.lp_grad is None or g.grad.data_ptr() != g.lp_grad[g.lo:g.hi].data_ptr()):
                out.append(g.grad)  # (stage 2 holds none between steps)
    if kind == OffloadStateTypeEnum.lp_params and getattr(engine, "nvme_pieces", None) is not None:
        return []  # offload_param nvme: the pieces live in swap files, not on the accelerator
    if kind == OffloadStateTypeEnum.lp_params:
        for p in engine.module.parameters():
            if not p.requires_grad:  # frozen: the parameter itself, or at stage 3 its piece
                out.append(p.ds_tensor if hasattr(p, "ds_tensor") else p)
    if kind == OffloadStateTypeEnum.optim_states:
        for state in opt.optimizer.state.values():
            out += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return out


def _repoint(engine) -> None:
    """Views follow their bases: parameters (stage 3: pieces), fp32 masters of fp32 models, gradients of
    stages 0/1."""
    for g in engine.zero_optimizer.flat_groups:
        if hasattr(g, "zparams") and getattr(engine, "nvme_pieces", None) is not None:
            pass  # offload_param nvme: the pieces follow their swap group (nvme_params.py)
        elif hasattr(g, "zparams"):  # stage 3: each piece is a view of the sub-group's buffer
            for zp, off, s in zip(g.zparams, g.offsets, g.shards):
                zp.shard.data = g.flat[off:off + s]
        else:
            for p, off, n in zip(g.params, g.offsets, g.numels):
                p.data = g.flat[off:off + n].view(p.shape)
        own = getattr(g, "offloaded", False)  # ZeRO-Offload: master and fp32 gradients are tensors of their own
        if g.master.dtype == g.flat.dtype and not own:  # fp32: the master is the parameters' partition
            g.master.data = g.flat[g.lo:g.hi]
        if g.lp_grad is not None:
            g.attach_lp_grads()
            if g.grad.dtype == g.lp_grad.dtype and not own:
                g.grad.data = g.lp_grad[g.lo:g.hi]
        g.master.grad = g.grad


def offload_states(engine, include: Optional[Iterable] = None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True,
                   non_blocking: bool = False) -> None:
    if OffloadDeviceEnum(device) != OffloadDeviceEnum.cpu:
        raise ValueError(f"offload_states: device {device!r} is not supported; states offload to 'cpu'")
    kinds = [OffloadStateTypeEnum(k) for k in include] if include is not None else list(OffloadStateTypeEnum)
    if engine.zero_model is not None and OffloadStateTypeEnum.lp_params in kinds:
        engine.zero_model.release_all(include_persistent=True)  # stage 3: only pieces remain to move
    for kind in kinds:
        if kind in engine.offloaded_kinds():
            continue
        if kind == OffloadStateTypeEnum.contiguous_grad_buffer:
            engine.zero_optimizer.reducer.free_buffers()  # nothing lives in them between steps: reallocated on use
        else:
            for t in _kind_tensors(engine, kind):
                _move(t, "cpu", pin_memory, non_blocking)
        engine.mark_offloaded(kind)
    _settle(non_blocking)
    _repoint(engine)


def reload_states(engine, non_blocking: bool = False) -> None:
    had_params = OffloadStateTypeEnum.lp_params in engine.offloaded_kinds()
    home_is_host = {id(t) for t in engine.host_placed()}  # ZeRO-Offload's own tensors stay in host memory
    for kind in engine.offloaded_kinds():
        if kind != OffloadStateTypeEnum.contiguous_grad_buffer:
            for t in _kind_tensors(engine, kind):
                if id(t) not in home_is_host:
                    _move(t, engine.device, False, non_blocking)
        engine.mark_offloaded(kind, parked=False)
    _settle(non_blocking)
    _repoint(engine)
    if had_params and engine.zero_model is not None:
        engine.zero_model.refresh_persistent()  # stage 3: persistent parameters whole again


def get_state_devices(model, state: OffloadStateTypeEnum) -> Set[torch.device]:
    """The devices holding one kind of the engine's state (empty when it holds none)."""
    engine = model
    state = OffloadStateTypeEnum(state)
    if state == OffloadStateTypeEnum.contiguous_grad_buffer:
        return {b.device for b in engine.zero_optimizer.reducer.buffers}
    if state == OffloadStateTypeEnum.hp_params:
        return {g.master.device for g in engine.zero_optimizer.flat_groups}
    return {t.device for t in _kind_tensors(engine, state)}


def offloaded_tensors(engine):
    """Tensors of the offloaded kinds (memory accounting puts them under the host tier)."""
    parked = engine.offloaded_kinds()
    return [t for kind in parked if kind != OffloadStateTypeEnum.contiguous_grad_buffer
            for t in _kind_tensors(engine, kind)] + (
        [g.master for g in engine.zero_optimizer.flat_groups] if OffloadStateTypeEnum.lp_params in parked else [])
