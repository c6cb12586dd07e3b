"""ZeRO-3 leaf modules: a module whose whole subtree is fetched at its own forward, as one unit.

For modules whose children run irregularly (a mixture-of-experts block runs only some experts per
batch, in an order decided by the data): per-child hooks would gather in a rank- and batch-dependent
order. A leaf gathers every parameter below it before its forward and releases them after; its
descendants get no hooks. DeepSpeed's names: set_z3_leaf_modules, unset_z3_leaf_modules,
set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, set_z3_leaf_module, get_z3_leaf_modules,
z3_leaf_module, z3_leaf_parameter. Mark leaves before the engine is built. The config can mark them
too: ``leaf_module`` (classes, names, suffixes) and ``stage3_module_granularity_threshold`` (every module
whose parameters per layer are at most the threshold: set_leaf_modules_by_granularity).
"""
import logging
import sys
from typing import Iterable, List, Sequence, Tuple, Union

import torch

LEAF_ATTR = "_z3_leaf"
logger = logging.getLogger("zero_ext.zero")


def _matches(module: torch.nn.Module, classes: Sequence[Union[type, str]]) -> bool:
    cls = type(module)
    for c in classes:
        if isinstance(c, type):
            if isinstance(module, c):
                return True
        elif c in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
            return True
    return False


def _check_classes(leaf_module_classes) -> None:
    bad = [c for c in leaf_module_classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be types or class names (str), got {bad!r}")


def _flag_by_class(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]], flag: bool,
                   raise_if_not_found: bool) -> List[torch.nn.Module]:
    _check_classes(leaf_module_classes)
    found = [m for m in model.modules() if _matches(m, leaf_module_classes)]
    if not found and raise_if_not_found:
        raise ValueError(f"no module of the classes {list(leaf_module_classes)!r} in the model "
                         f"({type(model).__name__}); pass raise_if_not_found=False to allow none")
    for m in found:
        setattr(m, LEAF_ATTR, flag)
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]],
                        raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Marks every module of the given classes (types, class names or qualified names) as a leaf and
    returns them; none found is a ValueError unless ``raise_if_not_found=False`` (DeepSpeed's default)."""
    return _flag_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[Union[type, str]],
                          raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Clears the leaf mark of every module of the given classes (same matching and refusal)."""
    return _flag_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_module(module: torch.nn.Module, flag: bool) -> None:
    """Marks (``flag=True``) or unmarks one module."""
    setattr(module, LEAF_ATTR, bool(flag))


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Sets the leaf mark to ``flag`` on the modules named (exact names from ``model.named_modules()``).
    Returns (the modules changed, the names not found); names not found are a ValueError unless
    ``raise_if_not_found=False``, and then nothing is changed."""
    by_name = dict(model.named_modules())
    missing = [n for n in module_names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing!r} in the model ({type(model).__name__}); "
                         "names are those of model.named_modules()")
    found = [by_name[n] for n in module_names if n in by_name]
    for m in found:
        setattr(m, LEAF_ATTR, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Sets the leaf mark to ``flag`` on every module whose name (``model.named_modules()``) ends with
    one of the suffixes. Returns (the modules changed, each once; the suffixes that matched nothing);
    unmatched suffixes are a ValueError unless ``raise_if_not_found=False``, and then nothing is changed."""
    named = list(model.named_modules())
    missing = [s for s in module_name_suffixes if not any(n.endswith(s) for n, _ in named)]
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {missing!r} in the model ({type(model).__name__})")
    found, seen = [], set()
    for s in module_name_suffixes:
        for n, m in named:
            if n.endswith(s) and id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    for m in found:
        setattr(m, LEAF_ATTR, flag)
    return found, missing


def z3_leaf_module(module: torch.nn.Module) -> bool:
    # the instance's dict first: a missed getattr on a Module goes through its slow __getattr__ (per call)
    flag = module.__dict__.get(LEAF_ATTR)
    return bool(flag if flag is not None else getattr(type(module), LEAF_ATTR, False))


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


# -- zero_optimization.stage3_module_granularity_threshold ----------------------------------------------------

_MAX_LEAF_ELEMENTS = 10 ** 9  # a larger subtree is never one leaf: it would hold too much gathered at once
_CONTAINERS = frozenset(torch.nn.modules.container.__all__)  # ModuleList & co. may never run forward


def module_granularity(model: torch.nn.Module) -> dict:
    """id(module) -> its granularity, DeepSpeed's measure of how fine-grained a module is: the parameter
    elements of its subtree divided by its layers (itself plus the torch leaf modules below it, containers
    not counted). Modules without parameters, torch leaf modules, containers and subtrees over 1e9
    elements get sys.maxsize (never a leaf by threshold)."""
    out = {}

    def walk(m):  # -> (layers, parameter elements) of m's subtree
        if next(m.parameters(), None) is None:
            out[id(m)] = sys.maxsize
            return 0, 0
        params = sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False))
        children = list(m.children())
        if not children:
            out[id(m)] = sys.maxsize
            return 1, params
        layers = 0
        for c in children:
            c_layers, c_params = walk(c)
            layers, params = layers + c_layers, params + c_params
        if type(m).__name__ in _CONTAINERS:
            out[id(m)] = sys.maxsize
            return layers, params
        layers += 1
        out[id(m)] = params // layers if params <= _MAX_LEAF_ELEMENTS else sys.maxsize
        return layers, params

    walk(model)
    return out


def set_leaf_modules_by_granularity(model: torch.nn.Module, threshold: int) -> List[torch.nn.Module]:
    """``stage3_module_granularity_threshold``: marks as leaves the outermost modules whose granularity
    is at most ``threshold`` (parents before children: a marked module's subtree is not searched). When
    no module qualifies, warns with the smallest granularity there is. Returns the modules marked."""
    if threshold <= 0:
        return []
    granularity = module_granularity(model)
    finest = min(granularity.values())
    if finest > threshold:
        smallest = next(type(m).__name__ for m in model.modules() if granularity[id(m)] == finest)
        logger.warning("stage3_module_granularity_threshold = %d marks no leaf module: the smallest module "
                       "granularity is %s (%s); set the threshold to at least that to use it", threshold,
                       finest, smallest)
        return []
    marked = []

    def visit(m):
        if next(m.parameters(), None) is None:
            return
        if granularity[id(m)] <= threshold:
            setattr(m, LEAF_ATTR, True)
            marked.append(m)
            return
        for c in m.children():
            visit(c)

    visit(model)
    logger.info("stage3_module_granularity_threshold = %d: %d leaf modules (%s)", threshold, len(marked),
                ", ".join(sorted({type(m).__name__ for m in marked})))
    return marked
