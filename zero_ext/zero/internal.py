"""zero_ext's own tensor work, hidden from zero_ext's TorchFunctionModes (a leaf: imports nothing).

zero.Init's construction mode (init.py) and the external-parameter detector (external.py) watch the
user's torch calls. The tensor operations of zero_ext itself -- gathering, partitioning, broadcasting --
must not be watched: Init would cast an fp32 all-gather buffer to its dtype, and the detector would take
a gathered parameter for a foreign use. Code that does such work runs inside ``section()``; both modes
pass calls straight through while ``active()``. Per thread, like the mode stack itself.

``labelled(name)``: a profiler range for zero_ext's own work, opened only while a profiler records
(``record_function`` costs tens of microseconds even with none, paid per module per step otherwise).
"""
import contextlib
import threading

import torch
from torch.profiler import record_function

_NO_LABEL = contextlib.nullcontext()
_profiling = torch._C._autograd._profiler_enabled


def labelled(name: str):
    return record_function(name) if _profiling() else _NO_LABEL

_STATE = threading.local()


def active() -> bool:
    return getattr(_STATE, "depth", 0) > 0


class _Section:
    """The context ``section()`` returns: a plain class, cheaper than a generator context (entered
    several times per module call)."""

    __slots__ = ()

    def __enter__(self):
        _STATE.depth = getattr(_STATE, "depth", 0) + 1

    def __exit__(self, *exc):
        _STATE.depth -= 1
        return False


_SECTION = _Section()


def section() -> _Section:
    return _SECTION
