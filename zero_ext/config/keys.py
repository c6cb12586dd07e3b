"""The key walker: the pass over the raw dict that runs before pydantic validation.

Walking the user's dict along the schema, it

* renames DeepSpeed aliases to field names (``stage3_prefetch_bucket_size`` ->
  ``prefetch_bucket_size``), remembering the spelling for error messages;
* reports unknown keys with the closest valid key of *that* section (names and aliases);
* drops values that are the string ``"auto"`` (HF Trainer's placeholder) and records their paths:
  like DeepSpeed, "auto" means "use the default" (or, for the batch sizes, "derive it");
* sets aside top-level sections of DeepSpeed subsystems zero_ext does not have;
* lets each section migrate its deprecated keys (:meth:`.base.ConfigModel.migrate_raw`).

Doing this before pydantic, rather than in validators, gives every problem its exact path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Type

from .base import ConfigModel, alias_map, field_extra, submodel_of, valid_keys
from .errors import (ConfigDeprecationWarning, ConfigWarning, Problem, suggest,
                     unknown_key_message)
from .messages import join_path

AUTO = "auto"


@dataclass
class Report:
    """What the walk found: problems, "auto" paths, spellings, deprecations, warnings."""

    problems: List[Problem] = field(default_factory=list)
    auto_paths: List[str] = field(default_factory=list)
    spelling: Dict[str, str] = field(default_factory=dict)  # canonical path -> path as written
    warnings: List[tuple] = field(default_factory=list)  # (message, category)
    ignored: Dict[str, Any] = field(default_factory=dict)  # top-level sections set aside
    root: Any = None  # the top-level model, to find where a misplaced key belongs

    def problem(self, path: str, value: Any, message: str) -> None:
        self.problems.append(Problem(path, value, message))

    def deprecated(self, old: str, new: str) -> None:
        self.warnings.append((f"{old} is deprecated; use {new} instead",
                              ConfigDeprecationWarning))

    def warning(self, message: str) -> None:
        self.warnings.append((message, ConfigWarning))


def walk(data: Dict[str, Any], model: Type[ConfigModel], path: str,
         report: Report) -> Dict[str, Any]:
    """Return ``data`` with canonical keys, "auto" values removed and deprecated keys migrated.

    Values of the wrong type are left in place for pydantic to report.
    """
    if report.root is None:
        report.root = model
    aliases = alias_map(model)
    ignored = getattr(model, "ignored_sections_table", {})
    keeps_unknown = model.model_config.get("extra") == "allow"  # loosely typed feature sections
    out: Dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            report.problem(join_path(path, repr(key)), value, "keys must be strings")
            continue
        here = join_path(path, key)
        if key in ignored:
            report.ignored[key] = value
            continue
        name = key if key in model.model_fields else aliases.get(key)
        if name is None and keeps_unknown:
            out[key] = value
            continue
        if name is None:
            report.problem(here, value, _unknown_key(key, model, path, report))
            continue
        canonical = join_path(path, name)
        if name in out or (name != key and name in data):
            # Only an alias can collide: a plain name is seen once in a dict.
            report.problem(here, value, f"the same setting is given twice, as {name!r} and as "
                           f"its alias {key!r}; keep one")
            continue
        if name != key:
            report.spelling[canonical] = here
        if isinstance(value, str) and value == AUTO:
            report.auto_paths.append(canonical)
            continue
        out[name] = value
    out = model.migrate_raw(out, path, report)
    for name, value in list(out.items()):
        if name not in model.model_fields:
            continue
        sub = submodel_of(model.model_fields[name].annotation)
        if sub is not None and isinstance(value, dict):
            out[name] = walk(value, sub, join_path(path, name), report)
        elif field_extra(model, name).get("auto_inside") and isinstance(value, dict):
            out[name] = _drop_auto(value, join_path(path, name), report)
    return out


def _unknown_key(key: str, model: Type[ConfigModel], path: str, report: Report) -> str:
    candidates = valid_keys(model) + list(getattr(model, "ignored_sections_table", {}))
    if suggest(key, candidates) is None:
        homes = sections_with_key(report.root, key)
        if homes:
            return (f"unknown key {key!r} {'in ' + path if path else 'at the top level'}; it "
                    f"belongs in {' or '.join(homes[:3])}: move it there")
    return unknown_key_message(key, candidates, path)


def sections_with_key(root: Type[ConfigModel], key: str, path: str = "",
                      depth: int = 0) -> List[str]:
    """Paths of the sections (below ``path``) that accept ``key``: for misplaced keys."""
    found: List[str] = []
    for name, info in root.model_fields.items():
        sub = submodel_of(info.annotation)
        if sub is None or depth > 3:
            continue
        here = join_path(path, name)
        if key in valid_keys(sub):
            found.append(here)
        found += sections_with_key(sub, key, here, depth + 1)
    return found


def _drop_auto(params: Dict[str, Any], path: str, report: Report) -> Dict[str, Any]:
    """Free-form parameter dicts (optimizer/scheduler params): drop "auto" entries."""
    kept = {}
    for key, value in params.items():
        if isinstance(value, str) and value == AUTO:
            report.auto_paths.append(join_path(path, key))
        else:
            kept[key] = value
    return kept


def unknown_key_problems(data: Dict[str, Any], model: Type[ConfigModel], path: str,
                         what: str = "") -> List[Problem]:
    """Problems for keys of ``data`` that ``model`` does not define (used for params dicts)."""
    keys = valid_keys(model)
    return [Problem(join_path(path, k), v, unknown_key_message(str(k), keys, what or path))
            for k, v in data.items() if k not in keys]
