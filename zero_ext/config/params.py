"""Validation of the free-form ``params`` dicts of ``optimizer`` and ``scheduler``.

DeepSpeed passes these dicts as keyword arguments to the optimizer/scheduler constructor, so a
misspelt key surfaces as a ``TypeError`` deep inside ``initialize``. For the types we know, a
typed model checks them at load time instead; the dict handed to the engine keeps only the keys
the user gave (constructors supply their own defaults, as in DeepSpeed).
"""

from __future__ import annotations

from typing import Any, Collection, Dict, List, Tuple, Type

from pydantic import ValidationError

from .base import ConfigModel, field_extra
from .errors import MISSING
from .keys import unknown_key_problems
from .messages import problems_from_errors

ProblemTuple = Tuple[str, Any, str]


def check_params(model: Type[ConfigModel], params: Dict[str, Any], where: str,
                 auto_keys: Collection[str] = ()) -> Tuple[Dict[str, Any], List[ProblemTuple]]:
    """Validate ``params`` against ``model``.

    Returns the given keys with validated (coerced) values, and problems as (key relative to
    the section, value, message). ``where`` names the section in messages (e.g. "WarmupLR").
    ``auto_keys``: keys that were "auto" (already dropped) — a required key given as "auto"
    is left for the caller to fill, not reported missing.
    """
    problems: List[ProblemTuple] = [
        (p.path, p.value, p.message)
        for p in unknown_key_problems(params, model, "params", f"{where} params")]
    known = {k: v for k, v in params.items() if k in model.model_fields}
    try:
        typed = model.model_validate(known)
    except ValidationError as err:
        problems += [(p.path, p.value, p.message)
                     for p in problems_from_errors(err.errors(), "params")]
        return known, problems
    for name in model.model_fields:
        if not field_extra(model, name).get("required") or name in auto_keys:
            continue
        if name not in known:
            problems.append((f"params.{name}", MISSING, f"is required by {where}"))
        elif known[name] is None:
            problems.append((f"params.{name}", None, f"is required by {where}; null is not a "
                             "value for it"))
    clean = {k: getattr(typed, k) for k in known}
    return clean, problems


def defaults_of(model: Type[ConfigModel]) -> Dict[str, Any]:
    """Default of every parameter of ``model`` (what "auto" resolves to)."""
    return {name: info.get_default(call_default_factory=True)
            for name, info in model.model_fields.items()}


def auto_keys_under(context: Any, prefix: str) -> List[str]:
    """Names of "auto" parameters under ``prefix`` (e.g. "scheduler.params"), from the
    validation context the loader passes."""
    paths = (context or {}).get("auto_paths", ()) if isinstance(context, dict) else ()
    start = prefix + "."
    return [p[len(start):] for p in paths if p.startswith(start)]
