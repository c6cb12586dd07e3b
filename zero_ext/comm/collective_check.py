"""Every rank must call a collective API: a rank that does not fails with an explanation instead of
leaving the others hanging in the collectives that follow.

Each call site counts itself in on the process group's key-value store (gloo and NCCL both have one)
under a per-call key, with what it is about to do (e.g. which parameter), and waits — up to
ZERO_EXT_COLLECTIVE_CHECK_TIMEOUT seconds (120) — for every rank; ranks that arrive with different
arguments fail too, naming what each rank passed. Where the group has a native communicator already,
the ranks first meet in its agreement op: a rank busy in another collective (one step ahead of the
others, say) then fails at once with every other, each naming both, instead of at the timeout. It
costs a few store round trips, so the engine uses it where a mistake is common and the call is rare
(checkpoints), and the state routines only in debug mode (ZERO_EXT_DEBUG=1).
"""
import os
import time

import torch.distributed as dist

from . import native


class CollectiveMisuseError(RuntimeError):
    """A collective API called on some ranks only, or with different arguments on different ranks."""


def collective_timeout() -> float:
    return float(os.environ.get("ZERO_EXT_COLLECTIVE_CHECK_TIMEOUT", "120"))


def debug_enabled() -> bool:
    """ZERO_EXT_DEBUG=1: extra agreement checks (the state routines' full forms)."""
    return os.environ.get("ZERO_EXT_DEBUG", "0") not in ("", "0")


def check_all_ranks_call(what: str, seq: int, timeout: float = None, detail: str = "",
                         error=CollectiveMisuseError, hint: str = "") -> None:
    """Waits until every rank has called ``what`` for the ``seq``-th time, with the same ``detail``.
    Raises ``error`` (with ``hint`` appended) on a timeout or a mismatch."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    timeout = collective_timeout() if timeout is None else timeout
    carrier = native.existing()
    if carrier is not None:  # first through the native transport: a rank in another collective meets this
        try:                 # one there and both fail at once, naming both (csrc/comm_shm.h, shm_stamp)
            carrier.agree(what, timeout)
        except native.CommError as exc:
            if "did not arrive" in str(exc):
                raise error(_absent(what, "some", dist.get_world_size(), timeout, hint)) from None
            if "before arriving" in str(exc):  # a rank left (or died) without calling it
                raise error(f"{what} is collective, but not every rank called it ({exc}): call it on every "
                            f"rank (not under `if rank == 0:`){hint}") from None
            raise error(f"{what} is collective, but not every rank is calling it now: {exc}{hint}") from None
    store = dist.distributed_c10d._get_default_store()
    key = f"zero_ext/collective/{what}/{seq}"
    world, rank = dist.get_world_size(), dist.get_rank()
    store.set(f"{key}/{rank}", detail)
    arrived = store.add(key, 1)
    deadline = time.monotonic() + timeout
    pause = 0.0005  # ranks usually arrive within a millisecond of each other: poll fast, then back off
    while arrived < world:
        if time.monotonic() > deadline:
            raise error(_absent(what, arrived, world, timeout, hint))
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
        arrived = store.add(key, 0)
    if detail:
        details = [store.get(f"{key}/{r}").decode() for r in range(world)]
        if len(set(details)) > 1:
            listed = ", ".join(f"rank {r}: {d}" for r, d in enumerate(details))
            raise error(f"{what} is collective and every rank must pass the same arguments, but they differ "
                        f"({listed}){hint}")


def _absent(what: str, arrived, world: int, timeout: float, hint: str) -> str:
    return (f"{what} is collective, but only {arrived} of {world} ranks called it within {timeout:.0f}s: call it "
            f"on every rank (not under `if rank == 0:`){hint}")


def call_number(what: str) -> int:
    """How many times this rank has called ``what`` under the current process group (1 for the first),
    counted in the group's store, so a new group starts again at 1: the seq for check_all_ranks_call
    of an API that has no object of its own to count with."""
    if not dist.is_initialized():
        return 0
    store = dist.distributed_c10d._get_default_store()
    return store.add(f"zero_ext/calls/{what}/{dist.get_rank()}", 1)
