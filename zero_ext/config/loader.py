"""``load_config``: read a DeepSpeed config from wherever it comes and validate all of it.

Accepted sources, as in DeepSpeed's ``DeepSpeedConfig``: a dict, a path to a JSON file (``str``
or ``pathlib.Path``), or a urlsafe-base64 encoding of JSON; additionally a JSON string. Text is
read with the ``hjson`` package, as DeepSpeed reads it: JSON plus comments (``//``, ``#``,
``/* */``), trailing commas and unquoted keys; a key given twice in one object is an error.
"""

from __future__ import annotations

import base64
import binascii
import copy
import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

import hjson
from pydantic import ValidationError

from . import batch
from .errors import ConfigError, ConfigWarning, Problem, warn
from .keys import Report, walk
from .messages import problems_from_errors
from .optimizer import TYPED_PARAMS, AdamParams
from .params import defaults_of
from .sections import IGNORED_SECTIONS, section_is_disabled
from .toplevel import DeepSpeedConfig
from .zero import stage3_only_keys_given

logger = logging.getLogger("zero_ext.config")

ConfigSource = Union[Mapping[str, Any], str, os.PathLike, "DeepSpeedConfig"]


def load_config(source: ConfigSource, world_size: Optional[int] = None) -> DeepSpeedConfig:
    """Parse and validate a DeepSpeed config.

    ``source``: dict, JSON file path (str or Path), JSON text, urlsafe-base64 JSON, or an
    already loaded DeepSpeedConfig (returned as is).
    ``world_size``: data-parallel size; when given the batch triple is resolved now, otherwise
    call ``cfg.resolve_batch(world_size)`` once it is known (after init_distributed).

    Raises :class:`ConfigError` listing every problem found. Deprecated keys and ignored
    sections give :class:`ConfigWarning` s; "auto" values are logged once at INFO level.
    """
    if isinstance(source, DeepSpeedConfig):  # already loaded (e.g. passed on to initialize)
        if world_size is not None:
            source.resolve_batch(world_size)
        return source
    raw = read_source(source)
    report = Report()
    clean = walk(raw, DeepSpeedConfig, "", report)
    problems: List[Problem] = list(report.problems)
    cfg: Optional[DeepSpeedConfig] = None
    try:
        cfg = DeepSpeedConfig.model_validate(clean, context={"auto_paths": report.auto_paths})
    except ValidationError as err:
        problems += problems_from_errors(err.errors(), "", report.spelling)
    if cfg is not None:
        early = batch.check_batch_without_world_size(*cfg.given_batch())
        problems += [early] if early else []
    if problems or cfg is None:
        raise ConfigError(problems)
    # Batch keys given as "auto" resolve in resolve_batch(); the rest resolve now.
    auto = {p: None if p in batch.BATCH_KEYS else _resolved_value(cfg, p)
            for p in report.auto_paths}
    cfg.record_load(raw=copy.deepcopy(raw), ignored=report.ignored, auto_resolved=auto)
    _emit_warnings(cfg, report)
    if world_size is not None:
        cfg.resolve_batch(world_size, log=False)  # logged below, with the other "auto" keys
    _log_auto(cfg)
    return cfg


# -- sources -------------------------------------------------------------------------------------


def read_source(source: ConfigSource) -> Dict[str, Any]:
    """The config as a plain dict, from any accepted source."""
    if isinstance(source, Mapping):
        return _as_dict(copy.deepcopy(dict(source)), "the config dict")
    if isinstance(source, os.PathLike):
        return _read_file(Path(source))
    if not isinstance(source, str):
        raise ConfigError("expected a dict, a path to a JSON file, JSON text or base64 JSON, "
                          f"not {type(source).__name__}", value=source)
    if os.path.isfile(source):
        return _read_file(Path(source))
    text = source.strip()
    if _looks_like_an_object(text):
        return _as_dict(_parse_json(text, "the JSON string"), "the JSON string")
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        decoded = None
    if decoded is not None and _looks_like_an_object(decoded):
        return _as_dict(_parse_json(decoded, "the base64 config"), "the base64 config")
    raise ConfigError("is neither an existing file, JSON text, nor urlsafe-base64 JSON",
                      path="<source>", value=source)


_LEADING_COMMENTS = re.compile(r"\s*(?:(?:#|//)[^\n]*|/\*.*?\*/)", re.S)


def _looks_like_an_object(text: str) -> bool:
    """Whether config text starts with "{" once leading (hjson) comments are skipped."""
    pos, match = 0, _LEADING_COMMENTS.match(text)
    while match and match.end() > pos:
        pos = match.end()
        match = _LEADING_COMMENTS.match(text, pos)
    return text[pos:].lstrip().startswith("{")


def _read_file(path: Path) -> Dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read the config file: {err.strerror or err}",
                          path="<source>", value=str(path)) from err
    return _as_dict(_parse_json(text, str(path)), str(path))


def _reject_duplicates(pairs: List[tuple]) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _parse_json(text: str, where: str) -> Any:
    try:
        return hjson.loads(text, object_pairs_hook=_reject_duplicates)
    except hjson.HjsonDecodeError as err:
        raise ConfigError(f"is not valid JSON/hjson: {err.msg} at line {err.lineno} column "
                          f"{err.colno}", path=where) from err
    except ValueError as err:  # duplicate key
        raise ConfigError(f"{err} (each key may appear once per section)", path=where) from err


def _as_dict(value: Any, where: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError("must be a JSON object ({...}) at the top level", path=where,
                          value=value)
    return value


# -- after validation ----------------------------------------------------------------------------


def _resolved_value(cfg: DeepSpeedConfig, path: str) -> Any:
    """What a key given as "auto" resolved to (its default, or the derived value)."""
    for section in ("optimizer", "scheduler"):
        prefix = f"{section}.params."
        if path.startswith(prefix):
            holder = getattr(cfg, section)
            if section == "optimizer":
                model = AdamParams if holder.is_adam else TYPED_PARAMS.get(holder.type)
            else:
                model = holder.params_model
            # None: a torch class, whose own constructor default applies.
            return defaults_of(model).get(path[len(prefix):]) if model else None
    value: Any = cfg
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def _emit_warnings(cfg: DeepSpeedConfig, report: Report) -> None:
    for message, category in report.warnings:
        warn(message, category)
    active = sorted(k for k, v in report.ignored.items() if not section_is_disabled(v))
    if active:
        listing = ", ".join(f"{k} ({IGNORED_SECTIONS[k]})" for k in active)
        warn(f"zero_ext ignores these DeepSpeed sections, which are not about ZeRO: {listing}",
             ConfigWarning)
    useless = stage3_only_keys_given(cfg.zero_optimization)
    if useless:
        warn(f"zero_optimization keys {', '.join(useless)} only affect ZeRO stage 3 and have "
             f"no effect at stage {cfg.zero_optimization.stage}", ConfigWarning)


def _log_auto(cfg: DeepSpeedConfig) -> None:
    resolved = cfg.auto_resolved
    if not resolved:
        return
    pending = "<derived by resolve_batch(world_size)>"
    shown = ", ".join(f"{k}={pending if v is None and k in batch.BATCH_KEYS else repr(v)}"
                      for k, v in resolved.items())
    logger.info('config values given as "auto" resolved to: %s', shown)

