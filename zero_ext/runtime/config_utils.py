"""``deepspeed.runtime.config_utils``: the base class DeepSpeed's config sections (and libraries' own
sections built the same way) derive from, and the small dict readers scripts use.

``DeepSpeedConfigModel`` is a pydantic model that forbids unknown keys, validates assignments, accepts a
field by its name or its alias, drops values given as ``"auto"`` (HF's placeholder: "use the default";
``strict=True`` keeps them), and migrates deprecated fields. A field is deprecated when its
``json_schema_extra`` holds ``"deprecated": True``; ``"new_param"`` names its replacement (dotted for a
field of a sub-section), ``"new_param_fn"`` converts the old value (default: unchanged),
``"set_new_param": False`` only warns, ``"deprecated_msg"`` is added to the warning. Giving both the old
and the new field raises AssertionError, as DeepSpeed does.
"""
import logging
from typing import Any, Dict, List, Optional

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger("zero_ext")


class DeepSpeedConfigModel(BaseModel):
    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any):
        if not strict:
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}
        super().__init__(**data)
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated") and name in self.model_fields_set:
                self._migrate_deprecated(name, extra)

    def _migrate_deprecated(self, name: str, extra: Dict[str, Any]) -> None:
        new = extra.get("new_param", "")
        note = extra.get("deprecated_msg", "")
        logger.warning("config key %s is deprecated%s%s", name, f"; use {new} instead" if new else "",
                       f". {note}" if note else "")
        if not new or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda v: v)(getattr(self, name))
        *parents, leaf = new.split(".")
        holder = self
        for part in parents:
            holder = getattr(holder, part)
        assert leaf not in holder.model_fields_set, \
            f"config keys {name} (deprecated) and its replacement {new} are both given; keep {new}"
        setattr(holder, leaf, value)


def get_scalar_param(param_dict: Dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: Dict[str, Any], param_name: str, param_default_value: Optional[List]) -> Any:
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: Dict[str, Any], param_name: str, param_default_value: Optional[Dict]) -> Any:
    return param_dict.get(param_name, param_default_value)


__all__ = ["DeepSpeedConfigModel", "get_scalar_param", "get_list_param", "get_dict_param"]
