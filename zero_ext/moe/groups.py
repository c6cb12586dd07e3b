"""Expert-parallel (EP) and expert-data-parallel (EDP) process groups, one pair per ``ep_size``.

[Note: expert groups]
A mixture-of-experts layer with ``ep_size`` e spreads its experts over e ranks (an EP group: tokens go
to the rank holding their expert by an all-to-all inside it); the w / e EP groups hold the same experts,
so an expert's gradient is averaged over the ranks holding the same experts (its EDP group), never
over the whole world as a dense parameter's is. The groups of one ``ep_size`` are named
``ep_size_<e>`` (DeepSpeed's name, also each expert parameter's ``group_name``).

Layout (DeepSpeed's default, "E + D"): EP groups are consecutive ranks [i e, (i + 1) e); EDP groups are
strided [j, j + e, j + 2 e, ...]. With ``use_data_before_expert_parallel`` ("D + E") it is the other way
round: with d = w / e, EDP groups are consecutive [i d, (i + 1) d) and EP groups strided [j, j + d, ...].
With an mpu whose tensor-parallel size t > 1 and expert tensor parallelism, the EP and EDP groups are cut
from each data-parallel group (``expert_parallel_ranks``), so experts are also split t ways.

Every rank makes every group (torch.distributed's rule), in one order: the EDP groups, then the EP groups.
Groups belong to the default process group they were made under: once it is destroyed (and another
initialised) the registry starts empty again. Without torch.distributed (or on one rank) ``ep_size`` must
be 1 and both groups are None, which the collectives read as the (one-rank) world.
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .. import comm


class UnknownExpertGroup(KeyError):
    """A group name that was never created (a KeyError whose message reads as a sentence)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _Registry:
    """The groups made under one default process group: name -> (group, ranks) for EP and for EDP."""

    def __init__(self, world: Any):
        self.world = world
        self.ep: Dict[str, Tuple[Any, List[int]]] = {}
        self.edp: Dict[str, Tuple[Any, List[int]]] = {}


_registry = _Registry(None)
_mpu: Any = None
_expert_tp_size = 1  # the tensor-parallel size experts are split by (1: experts whole)


def _world() -> Any:
    return dist.group.WORLD if dist.is_initialized() else None


def _current() -> _Registry:
    global _registry, _expert_tp_size
    if _registry.world is not _world():  # made under a default group that is gone
        _registry = _Registry(_world())
        _expert_tp_size = 1
    return _registry


def group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"


# ---- the mpu (Megatron's model-parallel unit), DeepSpeed's ``groups.mpu``

def set_mpu(mpu: Any) -> None:
    """Registers the mpu (or None) whose tensor-parallel groups the MoE layers read (the engine's job)."""
    global _mpu
    _mpu = mpu


def get_mpu() -> Any:
    return _mpu


def _mpu_call(mpu: Any, names: Sequence[str], default: Any) -> Any:
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    return default


def tensor_parallel_world_size(mpu: Any = None) -> int:
    """The mpu's tensor-parallel size (1 without an mpu), under any of its spellings."""
    mpu = _mpu if mpu is None else mpu
    if mpu is None:
        return 1
    return int(_mpu_call(mpu, ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size",
                               "get_model_parallel_world_size"), 1))


def tensor_parallel_rank(mpu: Any = None) -> int:
    mpu = _mpu if mpu is None else mpu
    if mpu is None:
        return 0
    return int(_mpu_call(mpu, ("get_tensor_model_parallel_rank", "get_slice_parallel_rank",
                               "get_model_parallel_rank"), 0))


def tensor_parallel_group(mpu: Any = None) -> Any:
    mpu = _mpu if mpu is None else mpu
    if mpu is None:
        return None
    return _mpu_call(mpu, ("get_tensor_model_parallel_group", "get_slice_parallel_group",
                           "get_model_parallel_group"), None)


def pipeline_parallel_world_size(mpu: Any = None) -> int:
    mpu = _mpu if mpu is None else mpu
    if mpu is None:
        return 1
    return int(_mpu_call(mpu, ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"), 1))


def expert_tensor_parallel_world_size() -> int:
    """How many ways each expert is split by tensor parallelism (1 unless the EP groups came from an mpu)."""
    _current()
    return _expert_tp_size


# ---- rank layouts (pure: every rank computes the same lists)

def expert_and_data_parallel_ranks(world: int, ep_size: int, use_data_before_expert_parallel: bool = False,
                                   pp_size: int = 1) -> Tuple[List[List[int]], List[List[int]]]:
    """(EP groups, EDP groups) as rank lists, for each pipeline stage of world / pp_size ranks."""
    _check_divides(world, ep_size, pp_size)
    stage = world // pp_size
    data = stage // ep_size  # EP groups per stage: the size of an EDP group
    ep, edp = [], []
    for s0 in range(0, world, stage):
        if use_data_before_expert_parallel:
            edp += [list(range(s0 + i * data, s0 + (i + 1) * data)) for i in range(ep_size)]
            ep += [list(range(s0 + j, s0 + stage, data)) for j in range(data)]
        else:
            edp += [list(range(s0 + j, s0 + stage, ep_size)) for j in range(ep_size)]
            ep += [list(range(s0 + i * ep_size, s0 + (i + 1) * ep_size)) for i in range(data)]
    return ep, edp


def expert_parallel_ranks(world: int, tp_size: int, ep_size: int, pp_size: int = 1,
                          use_data_before_expert_parallel: bool = False) -> Tuple[List[List[int]], List[List[int]]]:
    """(EP groups, EDP groups) with tensor parallelism (DeepSpeed's E + M + D layout): each data-parallel
    group (the ranks with one tensor-parallel rank, stride tp) is cut into EP groups of ``ep_size``
    consecutive members; the members at one position of those EP groups form an EDP group."""
    if world % (tp_size * pp_size):
        raise ValueError(f"expert groups: tensor-parallel size {tp_size} x pipeline size {pp_size} does not "
                         f"divide the world of {world} ranks")
    dp_world = world // (tp_size * pp_size)
    if dp_world % ep_size:
        raise ValueError(f"expert groups: ep_size {ep_size} does not divide the data-parallel size {dp_world} "
                         f"(world {world} / tensor-parallel {tp_size} / pipeline {pp_size})")
    stage = world // pp_size
    dp_groups = []
    for s0 in range(0, world, stage):
        for i in range(tp_size):
            if use_data_before_expert_parallel:
                stride = dp_world // ep_size
                dp_groups.append([r for d in range(stride)
                                  for r in range(s0 + i + d * tp_size, s0 + stage, stride * tp_size)])
            else:
                dp_groups.append(list(range(s0 + i, s0 + stage, tp_size)))
    ep, edp = [], []
    for members in dp_groups:
        cut = [members[i:i + ep_size] for i in range(0, dp_world, ep_size)]
        ep += cut
        edp += [list(column) for column in zip(*cut)]
    return ep, edp


def _check_divides(world: int, ep_size: int, pp_size: int = 1) -> None:
    if ep_size < 1 or world % (ep_size * pp_size):
        stage = f" ({pp_size} pipeline stages of {world // max(pp_size, 1)})" if pp_size > 1 else ""
        raise ValueError(f"expert parallelism: ep_size {ep_size} does not divide the world of {world} ranks"
                         f"{stage}; choose an ep_size that divides the number of ranks (or run on a multiple "
                         f"of {ep_size} ranks)")


# ---- making the groups

def _make(name: str, ep_lists: List[List[int]], edp_lists: List[List[int]]) -> None:
    reg, rank = _current(), dist.get_rank()
    for kind, lists in (("edp", edp_lists), ("ep", ep_lists)):
        for ranks in lists:
            group = comm.new_group(ranks)
            if rank in ranks:
                getattr(reg, kind)[name] = (group, list(ranks))


def _single_process(ep_size: int) -> str:
    if ep_size != 1:
        raise ValueError(f"expert parallelism: ep_size {ep_size} needs {ep_size} ranks (a multiple of it), but "
                         "torch.distributed is not initialised (a world of 1 rank); call "
                         "deepspeed.init_distributed() under a launcher first, or use ep_size=1")
    name = group_name(1)
    reg = _current()
    reg.ep.setdefault(name, (None, [0]))
    reg.edp.setdefault(name, (None, [0]))
    return name


def create_expert_and_data_parallel(ep_size: int, use_data_before_expert_parallel: bool = False) -> str:
    """Makes the EP and EDP groups of ``ep_size`` (once: later calls find them) and returns their name.
    A collective over the world: every rank calls it, with the same arguments, in the same order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _single_process(ep_size)
    name = group_name(ep_size)
    reg = _current()
    if name in reg.ep and name in reg.edp:
        return name
    pp = pipeline_parallel_world_size()
    _make(name, *expert_and_data_parallel_ranks(dist.get_world_size(), ep_size, use_data_before_expert_parallel, pp))
    return name


def create_expert_data_and_model_parallel(ep_size: int, mpu: Any = None,
                                          use_data_before_expert_parallel: bool = False) -> str:
    """As create_expert_and_data_parallel, with experts split by the mpu's tensor parallelism too."""
    global _expert_tp_size
    mpu = _mpu if mpu is None else mpu
    if mpu is None:
        raise ValueError("expert tensor parallelism needs an mpu (Megatron's model-parallel unit): pass "
                         "mpu=... to deepspeed.initialize, or use enable_expert_tensor_parallelism=False")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _single_process(ep_size)
    name = group_name(ep_size)
    reg = _current()
    tp = tensor_parallel_world_size(mpu)
    if name not in reg.ep or name not in reg.edp:
        _make(name, *expert_parallel_ranks(dist.get_world_size(), tp, ep_size, pipeline_parallel_world_size(mpu),
                                           use_data_before_expert_parallel))
    _expert_tp_size = tp
    return name


# ---- looking them up

def _lookup(kind: str, name: str) -> Tuple[Any, List[int]]:
    table = getattr(_current(), kind)
    if name not in table:
        known = ", ".join(sorted(table)) or "none yet"
        what = "expert-parallel" if kind == "ep" else "expert-data-parallel"
        raise UnknownExpertGroup(f"no {what} group named {name!r} (known: {known}); the groups are made by "
                                 "deepspeed.initialize (MoE.set_deepspeed_parallelism) or "
                                 "create_expert_and_data_parallel(ep_size)")
    return table[name]


def expert_group_names() -> List[str]:
    return sorted(_current().ep)


def expert_parallel_group(name: str) -> Any:
    return _lookup("ep", name)[0]


def expert_data_parallel_group(name: str) -> Any:
    return _lookup("edp", name)[0]


def expert_parallel_group_ranks(name: str) -> List[int]:
    return list(_lookup("ep", name)[1])


def expert_data_parallel_group_ranks(name: str) -> List[int]:
    return list(_lookup("edp", name)[1])


def expert_parallel_groups() -> Dict[str, Any]:
    """name -> this rank's EP group (a new dict; DeepSpeed's callers test membership in it)."""
    return {name: group for name, (group, _) in _current().ep.items()}


def expert_data_parallel_groups() -> Dict[str, Any]:
    return {name: group for name, (group, _) in _current().edp.items()}


def _place(ranks: List[int]) -> int:
    return ranks.index(dist.get_rank()) if dist.is_initialized() else 0


def expert_parallel_world_size(name: str) -> int:
    return len(_lookup("ep", name)[1])


def expert_parallel_rank(name: str) -> int:
    return _place(_lookup("ep", name)[1])


def expert_data_parallel_world_size(name: str) -> int:
    return len(_lookup("edp", name)[1])


def expert_data_parallel_rank(name: str) -> int:
    return _place(_lookup("edp", name)[1])


def expert_broadcast_src_rank(name: str) -> int:
    """The global rank of this rank's EDP group's first member (the one whose experts others take)."""
    return _lookup("edp", name)[1][0]


def expert_parallel_src_rank(name: str) -> int:
    """The global rank of this rank's EP group's first member."""
    return _lookup("ep", name)[1][0]


def max_expert_size() -> Optional[int]:
    sizes = [int(name.rsplit("_", 1)[1]) for name in _current().ep]
    return max(sizes) if sizes else None


# ---- the data-parallel group (the mpu's, else the world)

def data_parallel_group() -> Any:
    """The dense parameters' data-parallel group: the mpu's, else the world (torch.distributed's WORLD)."""
    if _mpu is not None:
        if hasattr(_mpu, "initialize_sequence_parallel"):
            return None
        return _mpu.get_data_parallel_group()
    return _world()


def data_parallel_world_size() -> int:
    if _mpu is not None and not hasattr(_mpu, "initialize_sequence_parallel"):
        return int(_mpu.get_data_parallel_world_size())
    return comm.get_world_size(data_parallel_group())


def data_parallel_rank() -> int:
    if _mpu is not None and not hasattr(_mpu, "initialize_sequence_parallel"):
        return int(_mpu.get_data_parallel_rank())
    return comm.get_rank(data_parallel_group())


def sequence_data_parallel_group() -> Any:
    """The group ZeRO shards over with sequence parallelism (the mpu's), else the data-parallel group."""
    fn = getattr(_mpu, "get_sequence_data_parallel_group", None)
    return fn() if callable(fn) else data_parallel_group()


def sequence_data_parallel_world_size() -> int:
    fn = getattr(_mpu, "get_sequence_data_parallel_world_size", None)
    return int(fn()) if callable(fn) else data_parallel_world_size()


def sequence_data_parallel_rank() -> int:
    fn = getattr(_mpu, "get_sequence_data_parallel_rank", None)
    return int(fn()) if callable(fn) else data_parallel_rank()


def sequence_parallel_world_size() -> int:
    fn = getattr(_mpu, "get_sequence_parallel_world_size", None)
    return int(fn()) if callable(fn) else 1


def sequence_parallel_rank() -> int:
    fn = getattr(_mpu, "get_sequence_parallel_rank", None)
    return int(fn()) if callable(fn) else 0


def sequence_parallel_group() -> Any:
    fn = getattr(_mpu, "get_sequence_parallel_group", None)
    if not callable(fn):
        raise KeyError("no sequence-parallel group: the mpu (if any) has no get_sequence_parallel_group()")
    return fn()


def model_parallel_world_size() -> int:
    if _mpu is None or hasattr(_mpu, "initialize_sequence_parallel"):
        return 1
    return int(_mpu.get_model_parallel_world_size())
