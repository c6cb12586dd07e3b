"""Shared building blocks of the config schema.

Every section is a :class:`ConfigModel` (pydantic v2, unknown keys forbidden). Each field is
declared with :func:`option`, which keeps the documentation and our extra metadata (DeepSpeed
aliases, "stage 3 only", deprecation, notes on DeepSpeed's docs) on the field itself: the schema is
the single source of truth for validation *and* for docs/config.md.

Aliases are *not* pydantic aliases: the key walker (:mod:`.keys`) renames them to field names
before validation, so error locations always use DeepSpeed's canonical field names and the
original spelling can still be reported.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import Annotated, Any, Dict, Iterable, List, Optional, Sequence, Tuple, Type

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from .errors import ConfigError

#: Set while ConfigModel.__setattr__ validates an assignment (pydantic passes the whole model to the
#: "before" validators then).
_ASSIGNING: ContextVar[bool] = ContextVar("zero_ext_config_assigning", default=False)


def built_directly(info: ValidationInfo) -> bool:
    """True while a section is built by its class (``DeepSpeedZeroConfig(**section)``), not by load_config
    (which validates with a context) nor by an assignment to one of its fields."""
    return info.context is None and not _ASSIGNING.get()


class ConfigModel(BaseModel):
    """Base of every config section: unknown keys rejected, assignments re-validated."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        validate_default=True,
        protected_namespaces=(),
    )

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_spellings(cls, data: Any, info: ValidationInfo) -> Any:
        # DeepSpeed's code and tests build sections directly (DeepSpeedZeroConfig(**section_dict)): take
        # its aliases, deprecated keys and "auto" then as load_config does, by the same walk. load_config
        # has walked already and validates with a context, assignments pass the model's own (canonical)
        # fields: neither is walked again.
        if built_directly(info) and isinstance(data, dict) and data:
            return _walked(cls, data)
        return data

    def __setattr__(self, name: str, value: Any) -> None:
        # Assignments are validated too; report them as ConfigError like everything else.
        # pydantic has already stored the value when a model validator rejects it: put the
        # old one back so a refused assignment changes nothing.
        before = dict(self.__dict__)
        token = _ASSIGNING.set(True)
        try:
            super().__setattr__(name, value)
        except ValidationError as err:
            from .messages import problems_from_errors  # (here: messages imports this module)

            self.__dict__.clear()
            self.__dict__.update(before)
            raise ConfigError(problems_from_errors(err.errors())) from None
        finally:
            _ASSIGNING.reset(token)

    @classmethod
    def migrate_raw(cls, data: Dict[str, Any], path: str, report: Any) -> Dict[str, Any]:
        """Hook: rewrite deprecated keys of this section (already canonical names) before
        validation. ``report`` collects problems and warnings (see :class:`.keys.Report`)."""
        return data


def _walked(model: Type["ConfigModel"], data: Dict[str, Any]) -> Dict[str, Any]:
    """``data`` for a section built directly: aliases renamed, deprecated keys migrated (with their
    warnings), and every key problem raised at once (a ValidationError, as for any other bad value)."""
    from .errors import warn
    from .keys import Report, walk  # (keys imports this module)

    report = Report()
    clean = walk(dict(data), model, "", report)
    if report.problems:
        raise rule_errors((p.path, p.value, p.message) for p in report.problems)
    for message, category in report.warnings:
        warn(message, category)
    return clean


def option(
    default: Any = ...,
    doc: str = "",
    *,
    aliases: Sequence[str] = (),
    ge: Optional[float] = None,
    gt: Optional[float] = None,
    le: Optional[float] = None,
    stage3_only: bool = False,
    deprecated: Optional[str] = None,
    ds_note: Optional[str] = None,
    default_factory: Any = None,
    shown_default: Optional[str] = None,
    required: bool = False,
    auto_inside: bool = False,
) -> Any:
    """Declare a config field.

    ``doc``: meaning, in our words. ``aliases``: other DeepSpeed spellings accepted for the key.
    ``stage3_only``: the key has an effect only with ZeRO stage 3 (a warning is given otherwise).
    ``deprecated``: what replaces the key. ``ds_note``: where DeepSpeed's docs or code differ.
    ``shown_default``: how docs show the default (e.g. ``"sys.maxsize"``). ``required``: a
    parameter that must be given (or "auto") although the schema stores None when absent.
    ``auto_inside``: a free-form dict (optimizer/scheduler params) whose "auto" entries are
    dropped like those of typed sections.
    """
    extra: Dict[str, Any] = {}
    if aliases:
        extra["aliases"] = list(aliases)
    if stage3_only:
        extra["stage3_only"] = True
    if deprecated:
        extra["deprecated"] = deprecated
    if ds_note:
        extra["ds_note"] = ds_note
    if shown_default:
        extra["shown_default"] = shown_default
    if required:
        extra["required"] = True
    if auto_inside:
        extra["auto_inside"] = True
    kwargs: Dict[str, Any] = dict(description=doc, json_schema_extra=extra or None)
    for name, bound in (("ge", ge), ("gt", gt), ("le", le)):
        if bound is not None:
            kwargs[name] = bound
    if default_factory is not None:
        return Field(default_factory=default_factory, **kwargs)
    return Field(default, **kwargs)


# --------------------------------------------------------------------------------------------
# Value types. JSON has no integer/float distinction for 5e8, and pydantic's lax mode would take
# `true` as 1; DeepSpeed users write 5e8 for sizes, but a boolean for a size is always a mistake.


def _number_not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("bool_for_number", "must be a number, not a boolean")
    if isinstance(value, (list, tuple, dict, set)):  # (pydantic's own message does not say what was given)
        raise PydanticCustomError("container_for_number", "must be a number, not a {kind}",
                                  {"kind": type(value).__name__})
    return value


def _finite(value: Any) -> Any:
    value = _number_not_bool(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise PydanticCustomError("not_finite", "must be a finite number (not inf or nan)")
    return value


#: Every integer key fits a signed 64-bit integer (what torch and the C code take).
INT64_MAX = 2 ** 63 - 1
#: Element counts (sizes, thresholds): the C planner's limit (csrc/planner.c, ZX_MAX_ELEMS), so sums
#: of a few of them still fit int64.
MAX_ELEMENTS = 2 ** 62


def _int64(value: Any) -> Any:
    value = _finite(value)
    if isinstance(value, (int, float)) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise PydanticCustomError(
            "int64_range", "must be an integer within the signed 64-bit range (|value| < 2**63)")
    return value


#: An integer; integral floats such as 5e8 are accepted (pydantic converts 5e8 -> 500000000).
#: Values outside int64 are refused here; fields add their own tighter ranges.
Int = Annotated[int, BeforeValidator(_int64)]
#: A finite real number.
Float = Annotated[float, BeforeValidator(_finite)]


def lower_str(value: Any) -> Any:
    """Case-insensitive string choices (DeepSpeed lower-cases e.g. communication_data_type)."""
    return value.lower() if isinstance(value, str) else value


def upper_str(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


# --------------------------------------------------------------------------------------------
# Errors from validators. pydantic only keeps ValueError/AssertionError/PydanticCustomError from
# validators, and a model validator's error is located at the model. A "rule error" carries the
# exact key (relative to the model) and value so ConfigError can name them.

RULE_ERROR = "zero_ext_rule"


def rule_error(key: str, value: Any, message: str) -> PydanticCustomError:
    """An error about ``key`` (dotted, relative to the model raising it) with value ``value``."""
    return rule_errors([(key, value, message)])


def rule_errors(problems: Iterable[Tuple[str, Any, str]]) -> PydanticCustomError:
    """Several located problems raised at once (e.g. all bad scheduler params)."""
    items = list(problems)
    summary = "; ".join(f"{k}: {m}" for k, _, m in items)
    return PydanticCustomError(RULE_ERROR, "{summary}", {"summary": summary, "problems": items})


# --------------------------------------------------------------------------------------------
# Schema introspection shared by the key walker, unimplemented.py and docgen.


def field_extra(model: Type[BaseModel], name: str) -> Dict[str, Any]:
    """Our metadata dict of one field (empty when none)."""
    extra = model.model_fields[name].json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}


def alias_map(model: Type[BaseModel]) -> Dict[str, str]:
    """DeepSpeed alias -> canonical field name, for one section."""
    out: Dict[str, str] = {}
    for name in model.model_fields:
        for alias in field_extra(model, name).get("aliases", ()):
            out[alias] = name
    return out


def valid_keys(model: Type[BaseModel]) -> List[str]:
    """Every spelling accepted in a section: field names and aliases."""
    return list(model.model_fields) + list(alias_map(model))


def submodel_of(annotation: Any) -> Optional[Type[ConfigModel]]:
    """The ConfigModel inside ``annotation`` (``X`` or ``Optional[X]``), else None."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, ConfigModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = submodel_of(arg)
        if found is not None:
            return found
    return None


def field_default(model: Type[BaseModel], name: str) -> Any:
    """The default value of a field (calling default factories)."""
    return model.model_fields[name].get_default(call_default_factory=True)
