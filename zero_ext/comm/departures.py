"""Ranks that leave say why, so that the others' failed torch.distributed collectives name them.

On torch.distributed (``ZERO_EXT_COMM=torch``, or ranks on several hosts) a rank that raises and exits
leaves the others with the backend's own text (gloo: ``Connection closed by peer``). So each rank, as
it goes — at interpreter exit (after an uncaught exception: naming it) or when
``zero_ext.comm.destroy_process_group`` ends the world — writes why under ``zero_ext/left/<rank>`` in
the default group's store, before its connections close; a collective of the facade that fails
(outstanding.run) looks there and raises a ``CommError`` naming the rank that left and why, the
backend's text after it. Nothing is found when the store went with the rank that left (rank 0 hosts
it) or the rank was killed: the backend's error is raised as it was. (The native transport does the
same in its segment: a seat's reason, csrc/comm_shm.c.)
"""
import atexit
import sys
from typing import Optional

import torch.distributed as dist

_KEY = "zero_ext/left/{}"


def _store():
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a group being torn down
        return None


def forget() -> None:
    """At init: a store outliving a group (torchrun's agent store) may hold an earlier run's word."""
    store = _store()
    if store is not None:
        try:
            store.delete_key(_KEY.format(dist.get_rank()))
        except Exception:  # noqa: BLE001 - stores without delete_key
            pass


def announce(reason: str) -> None:
    """This rank is leaving, because ``reason``."""
    store = _store()
    if store is None or dist.get_world_size() == 1:
        return
    try:
        store.set(_KEY.format(dist.get_rank()), reason[:300])
    except Exception:  # noqa: BLE001 - the store's host (rank 0) may be gone already
        pass


def explain(exc: BaseException, what: str):
    """A CommError naming the ranks that said they left, or None when none did."""
    store = _store()
    if store is None:
        return None
    left = []
    try:
        for r in range(dist.get_world_size()):
            key = _KEY.format(r)
            if r != dist.get_rank() and store.check([key]):
                left.append(f"rank {r} left: {store.get(key).decode(errors='replace')}")
    except Exception:  # noqa: BLE001 - the store went with rank 0
        return None
    if not left:
        return None
    from .native import CommError

    return CommError(f"zero_ext collective {what} failed: {'; '.join(left)} (torch.distributed said: "
                     f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__})")


@atexit.register
def _at_exit() -> None:
    last = getattr(sys, "last_value", None)  # set when the script ended by an uncaught exception
    announce(f"its process exited after {type(last).__name__}: {last}" if last is not None else
             "its process exited")
