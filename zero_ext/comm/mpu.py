"""DeepSpeed's ``mpu`` argument (a model-parallel unit, as Megatron-LM's ``mpu`` module) read once.

``initialize(mpu=...)`` takes an object with ``get_data_parallel_group()``, ``get_data_parallel_rank()``,
``get_data_parallel_world_size()`` and ``get_model_parallel_group() / _rank() / _world_size()`` (or the
``get_tensor_model_parallel_*`` spellings of newer Megatron). ZeRO partitions, reduces and averages over
the data-parallel group; the model-parallel group only enters the gradient norm: each model-parallel
rank holds different parameters, so their squared norms are summed over that group too, a parameter
marked ``model_parallel`` / ``tensor_model_parallel`` (Megatron's marks) on every rank and any other one
(replicated across model-parallel ranks: layer norms, biases) once, on model-parallel rank 0.
"""
from typing import Any, NamedTuple

from .process_groups import get_rank, get_world_size


class ParallelGroups(NamedTuple):
    dp_group: Any  # None: the world
    dp_rank: int
    dp_world: int
    mp_group: Any
    mp_rank: int
    mp_world: int


def _call(mpu, *names):
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    raise TypeError(f"zero_ext.initialize(mpu=...): the mpu ({type(mpu).__name__}) has no {' / '.join(names)}(); "
                    "DeepSpeed's mpu gives the data- and model-parallel groups, ranks and sizes (Megatron's mpu)")


def parallel_groups(mpu=None) -> ParallelGroups:
    """The data- and model-parallel groups of ``mpu``; without one every rank is data-parallel."""
    if mpu is None:
        return ParallelGroups(None, get_rank(), get_world_size(), None, 0, 1)
    groups = ParallelGroups(
        _call(mpu, "get_data_parallel_group"), int(_call(mpu, "get_data_parallel_rank")),
        int(_call(mpu, "get_data_parallel_world_size")),
        _call(mpu, "get_model_parallel_group", "get_tensor_model_parallel_group"),
        int(_call(mpu, "get_model_parallel_rank", "get_tensor_model_parallel_rank")),
        int(_call(mpu, "get_model_parallel_world_size", "get_tensor_model_parallel_world_size")))
    if get_world_size() % (groups.dp_world * groups.mp_world):
        raise ValueError(f"zero_ext.initialize(mpu=...): data-parallel size {groups.dp_world} x model-parallel size "
                         f"{groups.mp_world} does not divide the {get_world_size()} ranks; check the mpu's groups")
    return groups


def is_model_parallel_parameter(param) -> bool:
    """Whether ``param`` is split across model-parallel ranks (each holds another part), by Megatron's marks."""
    return bool(getattr(param, "model_parallel", False) or getattr(param, "tensor_model_parallel", False))
