"""The package's layout rules (docs/design.md, "Layers"), read from the source: imports point down the
layers only, the top level holds only the entry points, the builder and the engine, no file passes 600
lines, each package's docstring names its files, and no module assigns another object's private
attributes."""
import ast
import os
import re

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zero_ext")

# Top first: a module may import from its own unit or from units after it, never before it.
LAYERS = [
    ("__init__", "runtime", "launcher"),
    ("utils",),
    ("initialize",),
    ("build",),
    ("engine",),
    ("checkpoint", "activation_checkpointing"),
    ("optim",),
    ("zero",),
    ("precision",),
    ("nvme",),
    ("ops",),
    ("offload",),
    ("moe",),
    ("comm",),
    ("_native",),
    ("config",),
    ("accelerator", "_C"),
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}
TOP_LEVEL = {"__init__.py", "initialize.py", "build.py", "engine.py"}


def _modules():
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, PACKAGE)
                yield rel, ast.parse(open(path).read(), rel)


def _unit(parts):
    """The layer unit of a module given by its path parts below zero_ext ([] is the package itself)."""
    return parts[0].removesuffix(".py") if parts else "__init__"


def _imported(rel, node):
    """The zero_ext modules an import statement names, as part lists below zero_ext."""
    here = rel.removesuffix(".py").split(os.sep)
    package = here[:-1]
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "zero_ext"]
    if node.level == 0:
        if not (node.module or "").startswith("zero_ext"):
            return []
        base = node.module.split(".")[1:]
    else:
        base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
    return [base + [a.name] for a in node.names] if not node.module or not base else [base]


def test_imports_point_down_the_layers_only():
    upward = []
    for rel, tree in _modules():
        src = _unit(rel.split(os.sep))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for parts in _imported(rel, node):
                    dst = _unit(parts)
                    if dst == "__version__":
                        dst = "__init__"
                    if dst != src and RANK.get(dst, -1) <= RANK[src]:
                        upward.append(f"{rel}:{node.lineno} imports {'.'.join(['zero_ext'] + parts)}")
    assert upward == [], "\n".join(upward)


def test_every_unit_has_a_layer_and_the_top_level_holds_only_the_entry_builder_and_engine():
    entries = sorted(e for e in os.listdir(PACKAGE) if not e.startswith((".", "__pycache__")))
    modules = {e for e in entries if e.endswith(".py")}
    packages = {e for e in entries if os.path.isdir(os.path.join(PACKAGE, e))}
    assert modules == TOP_LEVEL
    assert {u.removesuffix(".py") for u in modules | packages} <= set(RANK)


def test_no_file_is_over_600_lines():
    long = [(rel, n) for rel, n in ((rel, len(open(os.path.join(PACKAGE, rel)).read().splitlines()))
                                    for rel, _ in _modules()) if n > 600]
    assert long == []


def test_each_package_docstring_names_its_files():
    missing = []
    for root, _, files in os.walk(PACKAGE):
        if root == PACKAGE or "__pycache__" in root or "__init__.py" not in files:
            continue
        doc = ast.get_docstring(ast.parse(open(os.path.join(root, "__init__.py")).read())) or ""
        for name in files:
            if name.endswith(".py") and name != "__init__.py" and not re.search(rf"\b{re.escape(name)}\b", doc):
                missing.append(os.path.relpath(os.path.join(root, name), PACKAGE))
        for sub in os.listdir(root):
            if os.path.isfile(os.path.join(root, sub, "__init__.py")) and f"{sub}/" not in doc:
                missing.append(os.path.relpath(os.path.join(root, sub), PACKAGE) + "/")
    assert missing == []


@pytest.mark.parametrize("owner_module", ["zero/param.py"])
def test_no_module_assigns_another_objects_private_attributes(owner_module):
    """``x._name = ...`` only on self/cls (and an autograd Function's ``ctx``, its own node's state); the
    one exception is the ZeRO-3 parameter's owner link, set on the parameter by its ZeroParam
    (zero/param.py), next to DeepSpeed's ds_* attributes."""
    stores = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for attr in ast.walk(target):
                    if (isinstance(attr, ast.Attribute) and attr.attr.startswith("_") and not attr.attr.startswith("__")
                            and not (isinstance(attr.value, ast.Name) and attr.value.id in ("self", "cls", "ctx"))):
                        stores.append(f"{rel}:{node.lineno} {ast.unparse(attr)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and str(node.args[1].value).startswith("_")):
                stores.append(f"{rel}:{node.lineno} setattr {node.args[1].value}")
    assert [s for s in stores if not s.startswith(owner_module)] == []


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "reduce", "broadcast", "barrier", "gather", "scatter", "all_to_all", "all_to_all_single", "send",
               "recv", "isend", "irecv", "gather_object", "all_gather_object", "broadcast_object_list"}


def test_collectives_run_only_through_the_comm_facade():
    """torch.distributed's collectives are called in comm/ only (comm/collectives.py is the one place that
    decides how ranks talk); everything else calls ``comm.<name>``."""
    direct = []
    for rel, tree in _modules():
        if rel.startswith("comm" + os.sep):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and isinstance(node.value, ast.Name)
                    and node.value.id == "dist"):
                direct.append(f"{rel}:{node.lineno} dist.{node.attr}")
    assert direct == []
