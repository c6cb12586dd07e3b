"""MiCS: ZeRO-3 with the model states sharded inside groups of ``mics_shard_size`` ranks.

[Note: MiCS partition groups]
With shard size s over a world of w ranks, ranks [k s, (k + 1) s) form shard group k: every parameter's
pieces, fp32 masters, gradient partitions and optimizer states are cut s ways inside it, exactly as plain
ZeRO-3 cuts them w ways (a shard group is an ordinary partition group: zp.group). The w / s shard groups
hold the same values (replicas); the ranks holding the same piece (shard rank r of every group: ranks
r, s + r, 2 s + r, ...) form replica group r. So:
- parameter gathers stay inside the shard group (fewer ranks, more of them on the same node);
- a gradient is reduce-scattered inside the shard group, then its piece all-reduced over the replica
  group (optim/shard_groups.py): the sum over all w ranks, averaged by w as always;
- the gradient norm sums the pieces of one shard group only (a replica's pieces are the same values);
- partitioning (zero.MiCS_Init, initialize) cuts global rank 0's value: shard group 0 scatters it, every
  other shard group receives its pieces over the replica groups, so replicas start identical even when
  scripts seed ranks differently;
- a checkpoint is written by shard group 0 (s optimizer files, its layout "world" s) and loads into any
  engine, MiCS or not, through the checkpoint's resharding (checkpoint/layout.py).

``mics_hierarchical_params_gather``: a shard group spanning n nodes of g ranks (s = n g) gathers in two
levels (collectives.all_gather_two_level_async): first across nodes among the g-th ranks of each node
(the inter-node group: each rank sends its piece once per other node), then inside the node (intra-node
group). The gathered value is the same bits as the flat gather's. Nodes are consecutive blocks of
``node_size`` global ranks (NDEV_PER_NODE, DeepSpeed's variable for it, else LOCAL_WORLD_SIZE, else the
accelerator's device count), as hpZ's node groups are (secondary.py): on one host, world 4 with
NDEV_PER_NODE=2 is two "nodes" of two ranks.
"""
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import comm
from ..config import ConfigError


@dataclass
class MiCSGroups:
    """This rank's MiCS process groups and its place in them (global ranks in the *_ranks lists)."""

    shard_size: int
    shard_group: object
    shard_rank: int
    shard_ranks: List[int]
    replicas: int  # world / shard_size
    replica_group: object  # None when replicas == 1
    replica_ranks: List[int]
    # two-level gather: (intra-node group, inter-node group, ranks per node in the shard group), or None
    hierarchy: Optional[Tuple[object, object, int]] = None
    node_size: int = 0
    _world: object = field(default=None, repr=False)  # the default group these were made under


_made: Dict[Tuple[int, bool, int], MiCSGroups] = {}
_by_group: Dict[int, MiCSGroups] = {}  # id(shard group) -> its MiCSGroups (the groups are kept alive by _made)


def node_size(world: int) -> int:
    """Ranks per node: NDEV_PER_NODE, else LOCAL_WORLD_SIZE (torchrun), else the devices, else the world."""
    for name in ("NDEV_PER_NODE", "LOCAL_WORLD_SIZE"):
        raw = os.environ.get(name, "")
        if raw:
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a number of ranks per node") from None
            if value < 1:
                raise ConfigError(f"{name}={raw!r} must be >= 1 (ranks per node)")
            return min(value, world)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return min(torch.cuda.device_count(), world)
    return world


def check(shard_size: int, hierarchical: bool, world: int, nodes: int) -> None:
    """The MiCS rules that need the world size: ConfigError naming the key and the fix."""
    key = "zero_optimization.mics_shard_size"
    if shard_size > world:
        raise ConfigError(f"{key} = {shard_size} is larger than the {world} ranks: a shard group cannot span more "
                          "ranks than there are; use a divisor of the world size")
    if world % shard_size:
        raise ConfigError(f"{key} = {shard_size} does not divide the {world} ranks: MiCS replicates whole shard "
                          "groups; use a divisor of the world size")
    if not hierarchical:
        return
    hkey = "zero_optimization.mics_hierarchical_params_gather"
    if shard_size <= nodes:
        raise ConfigError(f"{hkey} = true, but each shard group ({shard_size} ranks) lies inside one node of "
                          f"{nodes} ranks, so there is nothing to gather across nodes in two levels; set it to "
                          "false (or a mics_shard_size spanning several nodes)")
    if shard_size % nodes or world % nodes:
        raise ConfigError(f"{hkey} = true needs shard groups made of whole nodes: mics_shard_size = {shard_size} "
                          f"and the world size {world} must be multiples of the {nodes} ranks per node "
                          "(NDEV_PER_NODE / LOCAL_WORLD_SIZE)")


def mics_groups(shard_size: int, hierarchical: bool = False, new_group: Optional[Callable] = None) -> MiCSGroups:
    """This rank's MiCS groups for ``shard_size`` (made once per default group: every rank makes every
    group in the same order, as torch.distributed requires; zero.MiCS_Init and initialize share them)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    nodes = node_size(world)
    check(shard_size, hierarchical, world, nodes)
    key = (shard_size, hierarchical, nodes)
    default = dist.group.WORLD if dist.is_initialized() else None
    made = _made.get(key)
    if made is not None and made._world is default:
        return made
    new_group = new_group or comm.new_group
    found = {}
    for start in range(0, world, shard_size):  # shard groups: consecutive ranks
        ranks = list(range(start, start + shard_size))
        group = new_group(ranks)  # (the whole world too: the group names the MiCS layout, see of())
        if rank in ranks:
            found["shard"] = (group, ranks)
    replicas = world // shard_size
    for r in range(shard_size):  # replica groups: the same shard rank of every shard group
        ranks = list(range(r, world, shard_size))
        group = new_group(ranks) if replicas > 1 else None
        if rank in ranks:
            found["replica"] = (group, ranks)
    hierarchy = None
    if hierarchical:
        per_node = nodes
        start = rank - rank % shard_size
        for s0 in range(0, world, shard_size):
            for n0 in range(s0, s0 + shard_size, per_node):  # intra-node: one node's part of a shard group
                g = new_group(list(range(n0, n0 + per_node)))
                if n0 <= rank < n0 + per_node:
                    found["intra"] = g
            for i in range(per_node):  # inter-node: the i-th rank of each node of the shard group
                g = new_group(list(range(s0 + i, s0 + shard_size, per_node)))
                if s0 == start and rank % per_node == i:
                    found["inter"] = g
        hierarchy = (found["intra"], found["inter"], per_node)
    (shard_group, shard_ranks), (replica_group, replica_ranks) = found["shard"], found["replica"]
    groups = MiCSGroups(shard_size, shard_group, shard_ranks.index(rank), shard_ranks, replicas, replica_group,
                        replica_ranks, hierarchy, nodes, default)
    if made is not None:  # made under an earlier default group, now gone
        _by_group.pop(id(made.shard_group), None)
    _made[key] = groups
    _by_group[id(shard_group)] = groups
    return groups


def of(group) -> Optional[MiCSGroups]:
    """The MiCS groups whose shard group is ``group``, or None (a plain partition group)."""
    found = _by_group.get(id(group)) if group is not None else None
    return found if found is not None and found.shard_group is group else None
