"""ZeRO-3 leaf modules: a module whose whole subtree is fetched at its own forward, as one unit.

For modules whose children run irregularly (a mixture-of-experts block runs only some experts per
batch, in an order decided by the data): per-child hooks would gather in a rank- and batch-dependent
order. A leaf gathers every parameter below it before its forward and releases them after; its
descendants get no hooks. DeepSpeed's names: set_z3_leaf_modules, unset_z3_leaf_modules,
get_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter. Mark leaves before the engine is built.
"""
from typing import Iterable, List, Sequence, Union

import torch

LEAF_ATTR = "_z3_leaf"


def _matches(module: torch.nn.Module, classes: Sequence[Union[type, str]]) -> bool:
    cls = type(module)
    for c in classes:
        if isinstance(c, type):
            if isinstance(module, c):
                return True
        elif c in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
            return True
    return False


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]]) -> List[torch.nn.Module]:
    """Marks every module of the given classes (types, class names or qualified names) as a leaf."""
    marked = [m for m in model.modules() if _matches(m, leaf_module_classes)]
    for m in marked:
        setattr(m, LEAF_ATTR, True)
    return marked


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]]) -> List[torch.nn.Module]:
    unmarked = [m for m in model.modules() if _matches(m, leaf_module_classes)]
    for m in unmarked:
        setattr(m, LEAF_ATTR, False)
    return unmarked


def z3_leaf_module(module: torch.nn.Module) -> bool:
    return bool(getattr(module, LEAF_ATTR, False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether a parameter belongs to a leaf's subtree (set by the ZeRO-3 hooks)."""
    return bool(getattr(param, "ds_z3_leaf_module", False))


def get_z3_leaf_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def apply_leaf_config(model: torch.nn.Module, classes: Iterable[str], names: Iterable[str],
                      name_suffixes: Iterable[str]) -> List[torch.nn.Module]:
    """The config's ``zero_optimization.leaf_module``: by class name, by module name, by name suffix."""
    names, suffixes, classes = set(names), tuple(name_suffixes), list(classes)
    marked = []
    for name, m in model.named_modules():
        if name in names or (suffixes and name.endswith(suffixes)) or _matches(m, classes):
            setattr(m, LEAF_ATTR, True)
            marked.append(m)
    return marked
