"""Finding and replacing tensors inside a module's inputs and outputs (tuples, lists, dicts, named
tuples, dataclasses), without torch's private pytree."""
import dataclasses
from typing import Any, Callable, Iterator, List

import torch


def tensors_in(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (read-only walk; dataclasses and dict subclasses included)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _depth > 32:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item, _depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, field.name, None), _depth + 1)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with each tensor ``t`` replaced by ``fn(t)``, rebuilding plain tuples, lists, dicts and
    named tuples; other containers are returned unchanged (their tensors are not mapped)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) is list:
        return [map_tensors(v, fn) for v in obj]
    if type(obj) is tuple:
        return tuple(map_tensors(v, fn) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if type(obj) is dict:
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def mappable_tensors(obj: Any) -> List[torch.Tensor]:
    """The tensors ``map_tensors`` would reach, in the order it reaches them."""
    found: List[torch.Tensor] = []

    def visit(t):
        found.append(t)
        return t

    map_tensors(obj, visit)
    return found
