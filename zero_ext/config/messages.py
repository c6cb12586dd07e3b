"""Turn pydantic validation errors into :class:`~.errors.Problem` s that name the key path, the
value given and what is allowed, in words a DeepSpeed user recognises."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping

from .base import RULE_ERROR
from .errors import MISSING, Problem


def join_path(*parts: Any) -> str:
    """Dotted key path; list indices are written ``[i]``."""
    out = ""
    for part in parts:
        if part is None or part == "":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out


def as_written(path: str, spelling: Mapping[str, str]) -> str:
    """Replace canonical names by the spelling the user wrote (aliases), prefix by prefix."""
    if not spelling:
        return path
    parts = path.split(".")
    shown: List[str] = []
    for i in range(len(parts)):
        canonical = ".".join(parts[: i + 1])
        written = spelling.get(canonical)
        shown.append(written.split(".")[-1] if written else parts[i])
    return ".".join(shown)


_FIXED = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer (no fractional part)",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "dict_type": "must be an object ({...})",
    "model_type": "must be an object ({...})",
    "model_attributes_type": "must be an object ({...})",
    "missing": "is required",
    "none_required": "must be null",
}

_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def describe(error: Dict[str, Any]) -> str:
    """What is allowed, for one pydantic error dict."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _FIXED:
        return _FIXED[kind]
    if kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        return f"must be {sign} {ctx.get(key)}"
    if kind in ("enum", "literal_error"):
        return f"must be one of {ctx.get('expected')}"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"])).removeprefix("Value error, ")
    if kind == "assertion_error":
        return error["msg"].removeprefix("Assertion failed, ")
    return error["msg"]


def problems_from_errors(errors: Iterable[Dict[str, Any]], prefix: str = "",
                         spelling: Mapping[str, str] = {}) -> List[Problem]:
    """Problems for pydantic ``errors`` located under ``prefix`` (a dotted path)."""
    out: List[Problem] = []
    for error in errors:
        path = join_path(prefix, *error["loc"])
        if error["type"] == RULE_ERROR:
            for key, value, message in error["ctx"]["problems"]:
                out.append(Problem(as_written(join_path(path, key), spelling), value, message))
            continue
        value = MISSING if error["type"] == "missing" else error.get("input", MISSING)
        out.append(Problem(as_written(path, spelling), value, describe(error)))
    return out
