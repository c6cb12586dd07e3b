"""safe_get / safe_set: read and change partitioned state one parameter at a time (stages 0-3).

Where a parameter's elements live is its fragment map (comm/fragments.py over csrc/comm_state.c): in
stages 1/2 each parameter is one contiguous run of its group's flat buffer, so this rank holds at most
one fragment of it. The elements move in C: full forms rebuild the whole tensor from every rank's
fragment (an all-gather-v that moves only real bytes) and are therefore **collective**: every rank
must call them, with the same parameter; full setters copy this rank's run of the value; local forms
copy this rank's fragment: a 1-D tensor, possibly empty (DeepSpeed refuses local forms below stage 3).
This file keeps the lifecycle checks, the NVMe materialisation and DeepSpeed's names. Stage 0 keeps
everything on every rank: full and local forms agree.
Stage 3: each parameter is cut into pieces of ceil(numel / N); the local forms are this rank's whole
padded piece (``ds_tensor``'s shape, padding zero), as in DeepSpeed.

Gradients exist after ``engine.backward()`` and before the ``engine.step()`` that applies them; during
accumulation they are the (averaged) sum so far. Stages 0/1 reduce gradients only at the accumulation
boundary, so there their gradients can be read or set only after the last micro step's backward; the
first access reduces them (a collective, even for the local forms). Values are fp32, unscaled by the
fp16 loss scale, on the compute device. A parameter the engine does not own (frozen, or not in the
engine) gives None, as in DeepSpeed; setters ignore it. With ZERO_EXT_DEBUG=1 each full read first
checks that every rank makes it for the same parameter (collective_check.py): a rank that skips one
fails with an explanation instead of hanging.
"""
import functools
import itertools
from typing import Callable, Iterable, Optional

import torch

from ..comm.collective_check import check_all_ranks_call, debug_enabled
from ..comm.fragments import FLAT, SHARDS, Fragments
from ..engine import engine_of
from ..zero.param import zero_param_of


_FULL_CALLS = itertools.count(1)  # this process's full-form calls, matched across ranks in debug mode


def _collective(fn):
    """Full forms are collective. With ZERO_EXT_DEBUG=1 every call first checks that all ranks make it,
    for the same parameter, and fails naming the mismatch instead of hanging in the all-reduce."""
    @functools.wraps(fn)
    def call(param, *args, **kwargs):
        w = _where(param)
        if w is not None and debug_enabled():
            shape = tuple(getattr(param, "ds_shape", param.shape))
            check_all_ranks_call(fn.__name__, next(_FULL_CALLS),
                                 detail=f"group {w.gi} parameter {w.i} of shape {shape}",
                                 hint="; full forms gather every rank's fragment")
        return fn(param, *args, **kwargs)
    return call


def _in_memory(modified: bool):
    """With NVMe offload, the parameter's group (master, optimizer state) is brought into memory for the
    call and, for setters, written back (ZeroOptimizer.materialized); otherwise a plain call."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(param, *args, **kwargs):
            w = _where(param)
            if w is None or (w.opt.nvme is None and w.opt.nvme_pieces is None):
                return fn(param, *args, **kwargs)
            with w.opt.materialized([w.gi], modified=modified):
                return fn(param, *args, **kwargs)
        return call
    return wrap


class _Where:
    """One parameter's place: its engine and ZeRO optimizer, flat group, index, and the map of its
    fragments over the ranks (comm/fragments.py: the data path, in C)."""

    def __init__(self, engine, gi: int, i: int):
        self.engine, self.opt = engine, engine.zero_optimizer
        self.gi, self.g, self.i = gi, self.opt.flat_groups[gi], i
        g = self.g
        shards = getattr(g, "shards", None)  # stage 3: local forms are the padded piece (ds_tensor)
        if shards is not None:
            self.frags = Fragments(SHARDS, g.numels[i], g.offsets[i], shards[i], g.world, g.rank,
                                     group=getattr(g, "pg", None))  # (MiCS: the shard group)
        elif g.partitioned:
            self.frags = Fragments(FLAT, g.numels[i], g.offsets[i], g.part, g.world, g.rank,
                                     group=g.pg)  # (an expert group's: expert-data-parallel)
        else:  # stage 0: every rank holds the whole group
            self.frags = Fragments(FLAT, g.numels[i], g.offsets[i], g.part, 1, 0)
        self.part_offset = self.frags.part_at[self.frags.rank]
        self.local_length = self.frags.local_length

    def full(self, partition: torch.Tensor, shape, divisor: float = 1.0) -> torch.Tensor:
        """The whole parameter-shaped value: every rank's fragment, gathered in rank order (collective
        when the state is partitioned), divided by ``divisor``."""
        return self.frags.gather(partition, divisor).view(shape)


def _shape(param) -> torch.Size:
    """The parameter's full shape (a partitioned ZeRO-3 parameter's own shape is [0])."""
    return getattr(param, "ds_shape", param.shape)


def _where(param) -> Optional[_Where]:
    """param's place, or None when no live engine steps it (frozen, or not in an engine)."""
    engine = engine_of(param)
    place = engine.zero_optimizer.place_of(param) if engine is not None else None
    return None if place is None else _Where(engine, *place)


def _grads(w: _Where, what: str) -> torch.Tensor:
    """This rank's fp32 gradient partition of w's group, reduced; after the engine's lifecycle checks."""
    w.engine.gradients(what)
    return w.g.grad


def _own_param_grad(w: _Where, param, local: bool) -> Optional[torch.Tensor]:
    """Inside ``engine.coalesce_grad_reduction()`` at stages 2/3, where each backward's gradient stays
    summed in ``param.grad`` (stage 3: in the reducer's ``deferred``, by ZeroParam) until the block ends:
    this rank's own (unreduced) gradient, fp32 and still scaled, whole (1-D) or, ``local``, the fragment
    this rank's partition holds."""
    grad = param.grad
    if grad is None:
        deferred, zp = getattr(w.opt.reducer, "deferred", None), getattr(param, "_zero_owner", None)
        grad = deferred.get(id(zp)) if deferred is not None and zp is not None else None
    if grad is None:
        return None
    flat = grad.detach().reshape(-1).float()
    if not local:
        return flat
    g, i = w.g, w.i
    if getattr(g, "shards", None) is not None:  # stage 3: piece r of every parameter
        start = g.rank * g.shards[i]
    else:  # stage 2: the parameter's overlap with this rank's partition [lo, hi) of the flat buffer
        start = max(g.lo, g.offsets[i]) - g.offsets[i]
    return flat[start:start + w.local_length]


def _own_grads(w: _Where, lo: int, hi: int) -> torch.Tensor:
    """Inside ``engine.no_sync()`` (stages 0/1): [lo, hi) of this rank's own accumulated flat gradient of
    w's group, not averaged, in fp32 and still scaled (the callers divide by the loss scale). Stages 0/1
    hold the whole flat gradient on every rank, the buffer the parameters' ``.grad`` view (stage 1 with
    grad_accum_dtype fp32: the fp32 sum of the backward passes folded into it, plus any not folded yet)."""
    g = w.g
    g.collect_lp_grads()  # (a .grad that a model.zero_grad() detached from the buffer)
    own = g.lp_grad[lo:hi].float()
    return own + g.acc_grad[lo:hi] if g.acc_grad is not None else own


def _state(w: _Where, key: str, what: str) -> torch.Tensor:
    state = w.opt.optimizer.state.get(w.g.master, {})
    if key not in state or not torch.is_tensor(state[key]) or state[key].dim() == 0:
        have = [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]
        raise KeyError(f"{what}: {key!r} is not in the optimizer state (it holds {have}); "
                       "Adam creates exp_avg / exp_avg_sq at the first step()")
    return state[key]


def _value(value: torch.Tensor, w: _Where) -> torch.Tensor:
    return value.detach().to(device=w.g.master.device, dtype=torch.float32)


def _local_value(value: torch.Tensor, w: _Where, what: str) -> torch.Tensor:
    """A local setter's value, flat, checked against this rank's fragment."""
    value = _value(value, w).reshape(-1)
    if value.numel() != w.local_length:
        raise ValueError(f"{what}: this rank's fragment has {w.local_length} elements, the value {value.numel()}")
    return value


# -- read -------------------------------------------------------------------------------------------------

@_collective
@_in_memory(modified=False)
def safe_get_full_fp32_param(param) -> Optional[torch.Tensor]:
    """The fp32 master weights of param, full shape. Collective."""
    w = _where(param)
    return None if w is None else w.full(w.g.master.detach(), _shape(param))


@_collective
def safe_get_full_grad(param) -> Optional[torch.Tensor]:
    """The averaged fp32 gradient of param, full shape, unscaled. Collective. Inside ``engine.no_sync()``
    or ``engine.coalesce_grad_reduction()`` this rank's own accumulated gradient, not averaged (DeepSpeed's
    answer there), and no collective."""
    w = _where(param)
    if w is None:
        return None
    if w.engine.unaveraged_gradients("safe_get_full_grad"):
        if w.opt.stage >= 2:
            own = _own_param_grad(w, param, local=False)
            return None if own is None else (own / w.opt.cur_scale).view(_shape(param))
        off = w.g.offsets[w.i]
        return (_own_grads(w, off, off + w.g.numels[w.i]) / w.opt.cur_scale).view(_shape(param))
    return w.full(_grads(w, "safe_get_full_grad"), _shape(param), w.opt.cur_scale)


@_collective
@_in_memory(modified=False)
def safe_get_full_optimizer_state(param, optim_state_key: str) -> Optional[torch.Tensor]:
    """The optimizer state ``optim_state_key`` (e.g. "exp_avg") of param, full shape. Collective."""
    w = _where(param)
    return None if w is None else w.full(_state(w, optim_state_key, "safe_get_full_optimizer_state"), _shape(param))


@_in_memory(modified=False)
def safe_get_local_fp32_param(param) -> Optional[torch.Tensor]:
    """This rank's fragment of param's fp32 master weights (1-D, possibly empty)."""
    w = _where(param)
    return None if w is None else w.frags.read_local(w.g.master.detach())


def safe_get_local_grad(param) -> Optional[torch.Tensor]:
    """This rank's fragment of param's averaged fp32 gradient (1-D, unscaled); inside ``engine.no_sync()``
    or ``engine.coalesce_grad_reduction()`` the same fragment of this rank's own accumulated gradient, not
    averaged."""
    w = _where(param)
    if w is None:
        return None
    if w.engine.unaveraged_gradients("safe_get_local_grad"):
        if w.opt.stage >= 2:
            own = _own_param_grad(w, param, local=True)
            return None if own is None else own / w.opt.cur_scale
        return w.frags.read_local(_own_grads(w, w.g.lo, w.g.hi), w.opt.cur_scale)
    return w.frags.read_local(_grads(w, "safe_get_local_grad"), w.opt.cur_scale)


@_in_memory(modified=False)
def safe_get_local_optimizer_state(param, optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's fragment of param's optimizer state ``optim_state_key`` (1-D)."""
    w = _where(param)
    return None if w is None else w.frags.read_local(_state(w, optim_state_key, "safe_get_local_optimizer_state"))


# -- write ------------------------------------------------------------------------------------------------

@_in_memory(modified=True)
def safe_set_full_fp32_param(param, value: torch.Tensor) -> None:
    """Sets param's fp32 master weights and the model's copy (the next forward sees it). Every rank
    passes the same full value."""
    w = _where(param)
    if w is None:
        return
    value = _value(value, w)
    with torch.no_grad():
        w.frags.scatter(value, w.g.master)
        if hasattr(w.g, "shards"):  # stage 3: the model's copy is the piece (and the full value if gathered)
            w.frags.scatter(value, w.g.flat)
            zp = zero_param_of(param)
            if zp is not None and zp.status.name == "AVAILABLE":
                zp.full.copy_(value.view(zp.shape))
        else:
            param.data.copy_(value.view(param.shape))


@_in_memory(modified=True)
def safe_set_local_fp32_param(param, value: torch.Tensor) -> None:
    """Sets this rank's fragment of param's fp32 master weights (and of its model copy; the other ranks'
    copies follow at the next step's all-gather)."""
    w = _where(param)
    if w is None:
        return
    value = _local_value(value, w, "safe_set_local_fp32_param")
    with torch.no_grad():
        w.frags.write_local(value, w.g.master)
        lo = w.g.lo + w.part_offset
        w.g.flat[lo:lo + w.local_length].copy_(value)


def safe_set_full_grad(param, value: torch.Tensor) -> None:
    """Sets param's averaged gradient: what the next step() applies. Every rank passes the same value."""
    w = _where(param)
    if w is None:
        return
    grads = _grads(w, "safe_set_full_grad")
    w.frags.scatter(_value(value, w), grads, w.opt.cur_scale)


def safe_set_local_grad(param, value: torch.Tensor) -> None:
    """Sets this rank's fragment of param's averaged gradient."""
    w = _where(param)
    if w is None:
        return
    grads = _grads(w, "safe_set_local_grad")
    value = _local_value(value, w, "safe_set_local_grad")
    w.frags.write_local(value, grads, w.opt.cur_scale)


@_in_memory(modified=True)
def safe_set_full_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    """Sets param's optimizer state ``optim_state_key``. Every rank passes the same full value."""
    w = _where(param)
    if w is None:
        return
    state = _state(w, optim_state_key, "safe_set_full_optimizer_state")
    w.frags.scatter(_value(value, w), state)


@_in_memory(modified=True)
def safe_set_local_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    """Sets this rank's fragment of param's optimizer state ``optim_state_key``."""
    w = _where(param)
    if w is None:
        return
    state = _state(w, optim_state_key, "safe_set_local_optimizer_state")
    value = _local_value(value, w, "safe_set_local_optimizer_state")
    w.frags.write_local(value, state)


def safe_update_full_grad_vectorized(param_list: Iterable, update_func: Callable) -> None:
    """For each param: ``new = update_func(full_grad, param)``, then set it. Collective."""
    for p in param_list:
        old = safe_get_full_grad(p)
        if old is not None:
            safe_set_full_grad(p, update_func(old, p))
