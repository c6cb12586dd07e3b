"""``zero_optimization.pipeline_loading_checkpoint``: the ranks of one host load a checkpoint one after
another, in local-rank order, so that at most one rank's checkpoint files are in host memory at a time
(DeepSpeed's semantics: local rank 0 loads first and hands over to local rank 1, and so on; hosts load in
parallel). Each rank reads and applies its files in its turn and frees them before the next rank starts.

The turns are barriers that every rank passes however its own turn went: a rank whose read fails keeps
its error until every turn is over, so the others never wait for a rank that gave up.
"""
import socket
from typing import Callable, Optional, Tuple

from .. import comm


def local_turn(world: int) -> Tuple[int, int]:
    """(this rank's place among the ranks of its host, how many ranks its host has). Collective."""
    if world == 1:
        return 0, 1
    hosts = [None] * world
    comm.all_gather_object(hosts, socket.gethostname())
    mine = hosts[comm.get_rank()]
    same = [r for r, h in enumerate(hosts) if h == mine]
    return same.index(comm.get_rank()), max(hosts.count(h) for h in set(hosts))


def in_local_turns(world: int, work: Callable[[], object]) -> Tuple[object, Optional[BaseException]]:
    """Runs ``work`` on every rank, the ranks of a host one at a time. Collective. Returns (its result,
    None), or (None, the exception it raised); ``work`` must not call collectives."""
    place, turns = local_turn(world)
    result, error = None, None
    for turn in range(turns):
        if turn == place:
            try:
                result = work()
            except Exception as exc:  # (re-raised by the caller once every rank is past its turn)
                error = exc
        if world > 1:
            comm.barrier()
    return result, error
