"""Partitioned parameters refuse in-place writes: a named error instead of a write that is lost.

[Note: the write guard]
A partitioned parameter's ``data`` is an empty tensor, so ``p.normal_()``, ``p.data.copy_(w)`` or
``nn.init.xavier_uniform_(p)`` outside ``zero.Init`` and ``GatheredParameters`` would write nothing and
the user would train the model they did not mean to build. While a parameter is partitioned its
Python class is a subclass of its own class whose ``__torch_function__`` raises PartitionedWriteError,
naming the parameter, on any in-place write to it or to its ``.data`` (which it hands out as a guarded
alias for that reason), and on ``p.data = value`` with a non-empty value; every other call runs as
before. The parameter object stays the user's
(``isinstance(p, nn.Parameter)``, identity, hooks), and gathering swaps the class back, so a gathered
parameter -- every parameter a forward or backward computes with -- goes through no Python at all:
the guard costs one class assignment per gather and per release, and Python only on calls that reach a
partitioned parameter (the engine's gradient bookkeeping, a few per parameter per step). zero_ext's own
work (internal.py) and zero.Init's construction mode, which gathers a partitioned parameter before a
call reaches it (materialise.py), never meet the guard.

A class that defines its own ``__torch_function__`` is left unguarded rather than overridden.
Not guarded: aliases other than ``.data`` (``p.detach()``, which ``state_dict`` returns, is an empty
tensor of its own).
"""
from typing import Dict, Optional

import torch

from . import internal

_PLAIN = torch._C._disabled_torch_function_impl  # runs a function with subclass dispatch off
_DATA = torch._C.TensorBase.__dict__["data"]  # the descriptor behind ``p.data``

#: in-place methods that change only metadata, not values (``p.requires_grad_(False)`` freezes a
#: partitioned parameter, as it should)
_METADATA_INPLACE = frozenset(["requires_grad_", "share_memory_", "retain_grad_", "rename_", "detach_"])
_INPLACE_DUNDERS = frozenset(["__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__"])


class PartitionedWriteError(RuntimeError):
    """An in-place write reached a partitioned ZeRO-3 parameter, whose data is empty."""


def write_target(func, args, kwargs) -> Optional[object]:
    """What ``func(*args, **kwargs)`` writes into in place: a tensor, a list of tensors, or None.
    In-place methods (``x.normal_()``, ``x[i] = v``, ``x += y``) and ``torch.nn.init`` functions write
    their first argument; any function writes its ``out=``; ``x.data = value`` writes ``x`` when the
    value is not empty (``model.to(device)`` sets empty data on partitioned parameters)."""
    out = kwargs.get("out") if kwargs else None
    if out is not None:
        return out
    name = getattr(func, "__name__", "")
    if name == "__set__" and getattr(func, "__self__", None) is _DATA:
        return args[0] if len(args) == 2 and args[1].numel() else None
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")
                                    and name not in _METADATA_INPLACE):
        if args:
            return args[0]
        return kwargs.get("tensor") if kwargs else None  # torch.nn.init.normal_(tensor=p)
    return None


def _guarded_name(t) -> Optional[str]:
    """The parameter name if ``t`` is a guarded (partitioned) parameter or its ``.data`` alias."""
    owner = getattr(t, "_zero_owner", None)
    if owner is not None and type(t) is owner.guarded_class:
        return owner.name
    return getattr(t, "_zero_alias_of", None)


def _refuse(func, name: str) -> None:
    what = getattr(func, "__name__", str(func))
    raise PartitionedWriteError(
        f"zero_ext ZeRO-3: {what} writes in place into parameter {name!r}, which is partitioned (its data is "
        "an empty tensor, so the write would do nothing). Write inside "
        "`with zero_ext.zero.GatheredParameters(param, modifier_rank=0):` (that rank's value is kept on "
        "every rank), or inside zero.Init while the model is built.")


def _guarded_torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if internal.active():
        return _PLAIN(func, types, args, kwargs)
    target = write_target(func, args, kwargs)
    if target is not None:
        for t in (target if isinstance(target, (list, tuple)) else (target,)):
            name = _guarded_name(t)
            if name is not None:
                _refuse(func, name)
    result = _PLAIN(func, types, args, kwargs)
    if getattr(func, "__self__", None) is _DATA and getattr(func, "__name__", "") == "__get__":
        owner = getattr(args[0], "_zero_owner", None)
        if owner is not None:  # p.data: an alias that refuses writes too
            result = result.as_subclass(PartitionedData)
            result._zero_alias_of = owner.name
    return result


class PartitionedData(torch.Tensor):
    """``p.data`` of a partitioned parameter: the empty tensor, refusing in-place writes."""

    __torch_function__ = classmethod(_guarded_torch_function)


_CLASSES: Dict[type, type] = {}


def guarded_class(cls: type) -> type:
    """The class a partitioned parameter of class ``cls`` takes (``cls`` itself when it has its own
    ``__torch_function__``, see [Note: the write guard])."""
    guarded = _CLASSES.get(cls)
    if guarded is None:
        if cls.__torch_function__ is not _PLAIN:
            guarded = cls
        else:
            guarded = type(f"Partitioned{cls.__name__}", (cls,),
                           {"__torch_function__": classmethod(_guarded_torch_function),
                            "__module__": __name__,
                            "__doc__": f"A partitioned {cls.__name__} (see zero_ext/zero/guard.py)."})
        _CLASSES[cls] = guarded
    return guarded
