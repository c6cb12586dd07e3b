"""Errors and warnings raised while reading a DeepSpeed config.

Every mistake becomes a :class:`Problem` (where, what was given, what is allowed) and all problems
of one load are raised together as one :class:`ConfigError`, so a user fixes a file in one pass.

Diagnostics policy (one rule for the whole package):

* something the user must fix -> ``ConfigError`` (a ``ValueError``);
* something the user should change but that still loads (deprecated keys, sections of DeepSpeed
  subsystems zero_ext ignores, keys that do nothing at the chosen stage) -> ``warnings.warn`` with
  :class:`ConfigWarning` or :class:`ConfigDeprecationWarning` (shown by default, filterable);
* information ("auto" values and what they resolved to) -> ``logging.getLogger("zero_ext.config")``
  at INFO level, once per load.
"""

from __future__ import annotations

import difflib
import os
import sys
import warnings
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence

class _Missing:
    """The type of MISSING. Pickles as that one instance: a ConfigError holding it crosses process
    boundaries (a worker's exception sent back to its pool) and stays ``is MISSING`` there."""

    def __repr__(self) -> str:
        return "<missing>"

    def __reduce__(self) -> str:
        return "MISSING"


#: Marks "no value was given" (a missing key), as opposed to an explicit null.
MISSING: Any = _Missing()


class ConfigWarning(UserWarning):
    """A config that loads but should be changed (ignored sections, keys without effect)."""


class ConfigDeprecationWarning(ConfigWarning, FutureWarning):
    """A deprecated DeepSpeed key was given; it was migrated to its replacement.

    Derives from ``FutureWarning`` so that Python shows it by default: deprecations in a config
    file are aimed at end users, not at library developers.
    """


class Problem(NamedTuple):
    """One mistake: dotted key path, the value given (or MISSING) and what is wrong / allowed."""

    path: str
    value: Any
    message: str

    def render(self) -> str:
        where = self.path or "<top level>"
        if self.value is MISSING:
            return f"{where}: {self.message}"
        return f"{where}: got {format_value(self.value)}; {self.message}"


class ConfigError(ValueError, AssertionError):
    """An invalid DeepSpeed config. ``problems`` lists every mistake found in one load.

    A ``ValueError`` (what pydantic's ValidationError is) and an ``AssertionError`` (DeepSpeed checks
    many config rules with ``assert``), so callers written for DeepSpeed catch it either way."""

    headline = "Invalid DeepSpeed config"

    def __init__(self, problems: Sequence[Problem] | str, *, path: str = "", value: Any = MISSING):
        if isinstance(problems, str):
            problems = [Problem(path, value, problems)]
        self.problems: List[Problem] = list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return f"{self.headline}: " + self.problems[0].render()
        lines = [f"{self.headline} ({len(self.problems)} problems):"]
        lines += ["  - " + p.render() for p in self.problems]
        return "\n".join(lines)

    def __reduce__(self):
        # rebuilt from its problems (not from the rendered message, which would be rendered again)
        return (_rebuild_config_error, (type(self), self.problems), self.__dict__)

    @property
    def paths(self) -> List[str]:
        """The key paths named by the problems (handy in tests and tools)."""
        return [p.path for p in self.problems]


def _rebuild_config_error(cls, problems):
    error = cls.__new__(cls)
    error.problems = list(problems)
    Exception.__init__(error, error._render())
    return error


class UnimplementedFeatureError(ConfigError):
    """The config asks for a DeepSpeed feature zero_ext accepts but does not implement yet."""

    headline = "DeepSpeed config uses a feature zero_ext does not implement yet"


# -- errors with DeepSpeed's exception types ---------------------------------------------------------
# DeepSpeed raises AssertionError (its checks are asserts) or ZeRORuntimeException where zero_ext raises
# the errors below; each also derives from what zero_ext raised before, and keeps zero_ext's message.
# They live here, in the lowest layer that has errors, so every layer can raise them.


class ZeRORuntimeException(Exception):
    """DeepSpeed's ``deepspeed.runtime.zero.utils.ZeRORuntimeException``."""


class ClientOptimizerError(ConfigError, ZeRORuntimeException):
    """A client optimizer the config does not allow (e.g. with optimizer offload)."""


class UnsupportedDtypeError(ConfigError, NotImplementedError):
    """A data_types choice the engine does not implement for this stage and precision (DeepSpeed raises
    NotImplementedError for the combinations it lacks)."""


class UnsupportedCombinationError(NotImplementedError, AssertionError):
    """Features that do not run together (DeepSpeed asserts: e.g. its MoE layer at ZeRO stage 3)."""


class EngineUsageError(RuntimeError, AssertionError):
    """An engine call made when it cannot run (no optimizer, inside no_sync, out of step order)."""


class InitializeArgumentError(ValueError, AssertionError):
    """A bad argument to initialize (no model, an optimizer ZeRO does not allow)."""


def format_value(value: Any) -> str:
    """Show a value as the user wrote it in JSON-ish form, shortened when long."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    elif hasattr(value, "model_dump"):  # a config section: show what the user set
        text = repr(value.model_dump(mode="json", exclude_unset=True))
    elif hasattr(value, "value") and isinstance(getattr(value, "value"), (str, int)):
        text = repr(value.value)  # enums: show the plain value
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def suggest(key: str, candidates: Iterable[str]) -> Optional[str]:
    """Closest valid spelling of ``key`` among ``candidates`` (case-insensitive), or None."""
    by_lower = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    if match:
        return by_lower[match[0]]
    # Prefix typos ("stage3_prefetch_bucket" for "stage3_prefetch_bucket_size") score low in
    # difflib when the tail is long; accept a candidate that extends the key.
    longer = sorted(c for c in by_lower if c.startswith(key.lower()) and len(key) >= 4)
    return by_lower[longer[0]] if longer else None


def unknown_key_message(key: str, candidates: Sequence[str], section: str) -> str:
    """Message for an unknown key: the closest valid key, or the list of valid keys."""
    guess = suggest(key, candidates)
    if guess is not None:
        return f"unknown key {key!r}; did you mean {guess!r}?"
    where = f"in {section}" if section else "at the top level"
    shown = ", ".join(sorted(candidates)[:40])
    return f"unknown key {key!r} {where}; valid keys are: {shown} (see docs/config.md)"


def warn(message: str, category: type = ConfigWarning) -> None:
    """Emit a config warning attributed to the user's call site, not to this package."""
    warnings.warn(message, category, stacklevel=_first_outside_frame_level())


def _first_outside_frame_level() -> int:
    # warnings.warn's stacklevel counts from warn(); walk out of zero_ext (config and engine)
    # and pydantic so the warning points at the user's load_config()/initialize() line.
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    skip = (here, os.sep + "pydantic" + os.sep)
    frame, level = sys._getframe(2), 2
    while frame is not None and any(s in frame.f_code.co_filename for s in skip):
        frame, level = frame.f_back, level + 1
    return level
