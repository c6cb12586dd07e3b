"""Partitioned parameters refuse in-place writes: a named error instead of a write that is lost.

[Note: the write guard]
A partitioned parameter's ``data`` is an empty tensor, so ``p.normal_()``, ``p.data.copy_(w)`` or
``nn.init.zeros_(p)`` outside ``zero.Init`` and ``GatheredParameters`` would write nothing and the user
would train a model they did not mean to build. While a parameter is partitioned its Python class is
a subclass of its own class that overrides every in-place method of ``torch.Tensor`` (``normal_``,
``copy_``, ``fill_``, ..., ``x[i] = v``, ``x += y``, which ``torch.nn.init`` ends in) to raise
PartitionedWriteError naming the parameter; its ``data`` property hands out an alias with the same
overrides, and refuses ``p.data = value`` with a non-empty value (``model.to(device)`` sets empty data
on partitioned parameters and is allowed). Nothing else changes: the overrides are plain Python
methods, not a ``__torch_function__``, so every other attribute and call (``p.grad``, ``p.shape``,
``requires_grad_``) stays on torch's C path, and gathering swaps the class back, so a gathered
parameter -- every parameter a forward or backward computes with -- is the user's class untouched.
The guard costs one class assignment per gather and one per release (tens of nanoseconds).

Where the writes are meant: zero_ext's own work (internal.py) passes through, and under zero.Init the
overrides hand the call to torch, whose dispatch reaches Init's construction mode, which runs it on
the full value (materialise.py). Not guarded: calls that bypass the instance's methods
(``torch.add(x, y, out=p)``, ``torch._foreach_add_([p], 1)``, ``torch.Tensor.zero_(p)``) and aliases
other than ``.data`` (``p.detach()``, which ``state_dict`` returns, is an empty tensor of its own).
A class that defines its own ``__torch_function__`` (a tensor subclass) is left unguarded.
"""
from typing import Callable, Dict

import torch

from . import internal

_PLAIN = torch._C._disabled_torch_function_impl  # Parameter's __torch_function__: no Python dispatch
_DATA = torch._C.TensorBase.__dict__["data"]  # the descriptor behind ``p.data``

#: in-place methods that change only metadata, not values (``p.requires_grad_(False)`` freezes a
#: partitioned parameter, as it should)
_METADATA_INPLACE = frozenset(["requires_grad_", "share_memory_", "rename_", "detach_"])
_INPLACE_DUNDERS = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__",
                    "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                    "__irshift__")
WRITE_METHODS = tuple(sorted(
    n for n in dir(torch.Tensor)
    if (n.endswith("_") and not n.endswith("__") and n not in _METADATA_INPLACE) or n in _INPLACE_DUNDERS))

_UNDER_INIT = [0]  # zero.Init sessions open (init.py): writes go to its construction mode


class PartitionedWriteError(RuntimeError):
    """An in-place write reached a partitioned ZeRO-3 parameter, whose data is empty."""


def init_opened(opened: bool) -> None:
    """zero.Init entered (True) or left (False): while open, guarded writes go to its mode."""
    _UNDER_INIT[0] += 1 if opened else -1


def _passes() -> bool:
    return internal.active() or _UNDER_INIT[0] > 0


def _refuse(what: str, name: str) -> None:
    raise PartitionedWriteError(
        f"zero_ext ZeRO-3: {what} writes into parameter {name!r}, which is partitioned (its data is an "
        "empty tensor, so the write would do nothing). Write inside "
        "`with zero_ext.zero.GatheredParameters(param, modifier_rank=0):` (that rank's value is kept on "
        "every rank), or inside zero.Init while the model is built.")


def _name_of(t) -> str:
    owner = getattr(t, "_zero_owner", None)
    return owner.name if owner is not None else getattr(t, "partitioned_param_name", "?")


def _refusing(name: str, original: Callable) -> Callable:
    def write(self, *args, **kwargs):
        if _passes():
            return original(self, *args, **kwargs)
        _refuse(name, _name_of(self))
    write.__name__ = write.__qualname__ = name
    return write


def _data_get(self):
    data = _DATA.__get__(self)
    if _passes():
        return data
    alias = data.as_subclass(PartitionedData)
    alias.partitioned_param_name = _name_of(self)
    return alias


def _data_set(self, value):
    if value.numel() and not _passes():
        _refuse("`.data = value`", _name_of(self))
    _DATA.__set__(self, value)


def _overrides(base: type) -> dict:
    attrs = {name: _refusing(name, getattr(base, name)) for name in WRITE_METHODS}
    attrs["data"] = property(_data_get, _data_set)
    return attrs


#: ``p.data`` of a partitioned parameter: the empty tensor, refusing in-place writes (the results of
#: its calls are plain tensors)
PartitionedData = type("PartitionedData", (torch.Tensor,), {
    **{name: _refusing(name, getattr(torch.Tensor, name)) for name in WRITE_METHODS},
    "__torch_function__": _PLAIN, "__module__": __name__})


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
                           {**_overrides(cls), "__module__": __name__,
                            "__doc__": f"A partitioned {cls.__name__} (see zero_ext/zero/guard.py)."})
        _CLASSES[cls] = guarded
    return guarded
