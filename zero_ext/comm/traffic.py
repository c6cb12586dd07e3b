"""What this rank's collectives send, counted by the facade: bytes in all, and the part that crosses
"nodes" (consecutive blocks of ``node_size`` global ranks), per verb. Off unless started.

    from zero_ext.comm import traffic
    traffic.start(node_size=2)          # world 4 as two nodes of two ranks
    ... train ...
    traffic.snapshot()   # {"total": bytes, "cross_node": bytes, "by_verb": {verb: [total, cross_node]}}

The count is of the data each destination must receive from this rank, as if every rank sent it to every
other directly: an all-gather sends its input to each other member, a reduce-scatter or an all-to-all a
1/n share of its input to each, an all-reduce twice that (a reduce-scatter, then an all-gather), a
broadcast its tensor to each other member from the source. It is the volume a collective cannot do
without, whatever the transport's algorithm (a ring moves the same bytes per rank; a tree moves more), so
it compares configurations, e.g. ZeRO++'s cut in bytes across nodes (benchmarks/bench_zeropp.py); it is
not a packet count.
"""
import os
from typing import Dict, List, Optional

import torch.distributed as dist

# the share of `nbytes` each other member of the group receives, by the kind of verb
_PER_DESTINATION = {"gather": lambda nbytes, n: nbytes, "scatter": lambda nbytes, n: nbytes / n,
                    "all_reduce": lambda nbytes, n: 2 * nbytes / n, "broadcast": lambda nbytes, n: nbytes}

_state = {"node_size": None}
_totals = {"total": 0.0, "cross_node": 0.0}
_by_verb: Dict[str, List[float]] = {}


def start(node_size: Optional[int] = None) -> None:
    """Count from now on (counters reset). ``node_size``: ranks per node; by default LOCAL_WORLD_SIZE (the
    ranks torchrun started on this host), else the whole world (one node)."""
    if node_size is None:
        node_size = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or dist.get_world_size()
    if node_size < 1:
        raise ValueError(f"traffic.start: node_size must be >= 1, not {node_size}")
    reset()
    _state["node_size"] = int(node_size)


def stop() -> None:
    _state["node_size"] = None


def reset() -> None:
    _totals.update(total=0.0, cross_node=0.0)
    _by_verb.clear()


def snapshot() -> dict:
    """The counts so far: total and cross-node bytes, and [total, cross_node] per verb."""
    return {"total": int(_totals["total"]), "cross_node": int(_totals["cross_node"]),
            "by_verb": {verb: [int(a), int(b)] for verb, (a, b) in _by_verb.items()}}


def count(verb: str, kind: str, group, nbytes: int, src: Optional[int] = None) -> None:
    """Called by the facade for each collective (a no-op unless started): ``kind`` is "gather",
    "scatter", "all_reduce" or "broadcast" (see the module docstring), ``nbytes`` the input's bytes,
    ``src`` a broadcast's source (global rank)."""
    size = _state["node_size"]
    if size is None:
        return
    me = dist.get_rank()
    if kind == "broadcast" and src != me:
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    others = [r for r in ranks if r != me]
    remote = sum(1 for r in others if r // size != me // size)
    share = _PER_DESTINATION[kind](nbytes, len(others) + 1)
    row = _by_verb.setdefault(verb, [0.0, 0.0])
    row[0] += share * len(others)
    row[1] += share * remote
    _totals["total"] += share * len(others)
    _totals["cross_node"] += share * remote
