"""Outstanding collectives: the tensors torch.distributed's backend threads still hold, kept alive from
Python until those threads let go, so that no backend thread ever frees a Python object.

[Note: the exit race]
A gloo collective runs on the process group's worker thread, which destroys the finished work (and
with it the work's references to its tensors) a moment after ``wait()`` has returned on the main
thread. If Python has dropped a tensor by then, the worker's reference was the last one, and
destroying it frees the tensor's Python object: the worker takes the GIL. While the main thread is in
Py_FinalizeEx, taking the GIL ends the thread with pthread_exit, whose unwind crosses a noexcept C++
frame: ``terminate called without an active exception``, SIGABRT (docs/debugging.md shows it with
torch alone). So every collective of zero_ext runs through ``run`` (the facade, collectives.py, wraps
each with ``tracked``): the backend gets fresh aliases (``detach()``: same storage, a TensorImpl of
their own) that only this module holds in Python; an alias is done with once its ``_use_count()`` is
back to 1 (nothing in C++ refers to it) *and* its Python refcount is back to ours alone. The second
check matters since torch 2.10's PyObject preservation: a C++ reference beyond the first holds a
reference to the Python object too, and the thread that drops the C++ count from 2 to 1 decrefs the
Python object afterwards, once it has the GIL; between the two, ``_use_count()`` already reads 1, and
dropping our reference then would leave the backend's pending decref the last one. Once both read
"ours alone", dropping the alias here, on the calling thread, is safe.
``settle`` waits for that at the end of a step, a forward-only pass and ``engine.destroy()``; ``drain``
(also waiting for collectives still running) at exit, from an atexit hook that runs before the
interpreter finalizes, and before ``zero_ext.comm.destroy_process_group``. Finished entries are also
dropped at each new collective, so the aliases hold memory only until the next one.

A completed collective whose aliases stay referenced for more than SETTLE_SECONDS is held by something
else (a Work handle the caller keeps): it is no longer waited for, but its aliases stay here until
they are let go, whenever that is (no entry is dropped before).
"""
import atexit
import functools
import logging
import sys
import threading
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from . import departures

logger = logging.getLogger("zero_ext.comm")

SETTLE_SECONDS = 2.0  # how long a finished collective's aliases may stay held by C++ before it is given up on
EXIT_SECONDS = 30.0  # how long the exit hook waits for collectives still running (a dead peer fails sooner)
_POLL_SECONDS = 0.0005


class _Entry:
    __slots__ = ("work", "aliases", "done_at")

    def __init__(self, work, aliases: List[torch.Tensor]):
        self.work = work  # the async Work until it completes (None for a synchronous call)
        self.aliases = aliases
        self.done_at: Optional[float] = None if work is not None else time.monotonic()

    def update(self, now: float) -> bool:
        """True once the backend let go of every alias. Drops the Work when it completes (the Work itself
        refers to the aliases)."""
        if self.work is not None:
            if not self.work.is_completed():
                return False
            self.work, self.done_at = None, now
        return all(a._use_count() == 1 for a in self.aliases) and all(n == _ALONE for n in _refcounts(self.aliases))


def _refcounts(aliases: List[torch.Tensor]) -> List[int]:
    return [sys.getrefcount(a) for a in aliases]


_ALONE = _refcounts([torch.empty(0)])[0]  # an alias that only an entry's list holds, as _refcounts counts it
_lock = threading.Lock()
_entries: List[_Entry] = []


def _alias(value, aliases: List[torch.Tensor]):
    """A tensor, or a list/tuple of tensors, as fresh aliases (recorded in ``aliases``); anything else as is."""
    if isinstance(value, torch.Tensor):
        alias = value.detach()
        aliases.append(alias)
        return alias
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_alias(v, aliases) for v in value)
    return value


def run(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a torch.distributed collective) on aliases of its tensors, tracked until
    the backend lets go of them. Returns what ``fn`` returns (a Work when ``async_op``)."""
    aliases: List[torch.Tensor] = []
    args = tuple(_alias(a, aliases) for a in args)
    kwargs = {k: _alias(v, aliases) for k, v in kwargs.items()}
    result = None
    try:
        result = fn(*args, **kwargs)
        return result
    except RuntimeError as exc:  # (DistBackendError too) a peer that left says why: departures.py
        named = departures.explain(exc, getattr(fn, "__name__", "collective"))
        if named is not None:
            raise named from exc
        raise
    finally:  # (a collective that raised, e.g. for a dead peer, may still be held by the backend too)
        track(result if isinstance(result, dist.Work) else None, aliases)


def track(work, aliases: List[torch.Tensor]) -> None:
    """Keeps ``aliases`` (tensors only this module holds in Python, handed to a collective) until the
    backend lets go of them, and ``work`` (its async Work, or None) until it completes."""
    now = time.monotonic()
    with _lock:
        _entries[:] = [e for e in _entries if not e.update(now)]
        if aliases or work is not None:
            _entries.append(_Entry(work, aliases))


class _CaptureCollectives(TorchFunctionMode):
    """Routes the torch.distributed collectives that a torch function calls inside (an object
    collective pickles into tensors of its own and gathers those) through ``run``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == dist.distributed_c10d.__name__:
            return run(func, *args, **kwargs)
        return func(*args, **kwargs)


def tracked(fn: Callable) -> Callable:
    """``fn`` (a torch.distributed collective taking tensors) going through ``run``."""
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        return run(fn, *args, **kwargs)
    return collective


def tracked_objects(fn: Callable) -> Callable:
    """``fn`` (an object collective: gather_object, all_gather_object, ...) with the tensor collectives
    it runs inside going through ``run``."""
    @functools.wraps(fn)
    def collective(*args, **kwargs):
        with _CaptureCollectives():
            return fn(*args, **kwargs)
    return collective


def _update(now: float) -> List[_Entry]:
    """Drops the entries the backend let go of; returns the rest (call with _lock held)."""
    _entries[:] = [e for e in _entries if not e.update(now)]
    return list(_entries)


def pending() -> int:
    """How many collectives still have tensors the backend holds (or a Work still running)."""
    with _lock:
        return len(_update(time.monotonic()))


def settle(running: bool = False, timeout: float = EXIT_SECONDS) -> bool:
    """Waits until the backend has let go of the tensors of every finished collective (and, with
    ``running``, of those still running too, for up to ``timeout`` seconds), dropping them here.
    Collectives still running are otherwise left alone (a prefetch may be in flight). Returns whether
    nothing is left outstanding. See [Note: the exit race]."""
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        with _lock:
            left = _update(now)
        if not any((e.done_at is None and running and now < deadline)
                   or (e.done_at is not None and now - e.done_at < SETTLE_SECONDS) for e in left):
            break
        time.sleep(_POLL_SECONDS)
    running_left = sum(e.done_at is None for e in left)
    if running and running_left:
        logger.warning("%d collective(s) still running after %.0f s (a peer that never joined them?); their "
                       "tensors stay with torch.distributed's backend", running_left, timeout)
    return not left


def drain(timeout: float = EXIT_SECONDS) -> bool:
    """``settle`` including the collectives still running: nothing of torch.distributed's backend
    threads may refer to a Python object after this (at exit, before a process group is destroyed)."""
    return settle(running=True, timeout=timeout)


atexit.register(drain)  # runs before Py_FinalizeEx starts finalizing (see [Note: the exit race])
