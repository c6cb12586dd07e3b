"""Nested ``zero_optimization`` sub-sections: ``leaf_module`` and ``zenflow``.

Names and defaults follow DeepSpeed's ``runtime/zero/leaf_module_config.py`` and
``runtime/zenflow/zenflow_config.py`` (0.19.x).
"""

from __future__ import annotations

from typing import Annotated, Any, List, Optional

from pydantic import field_validator

from .base import ConfigModel, Float, Int, option

#: MoE blocks DeepSpeed treats as ZeRO-3 leaf modules by default (their routing is data dependent,
#: so per-submodule fetching would hang when ranks route differently).
DEFAULT_LEAF_MODULE_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


def _string_list(value: Any) -> Any:
    # DeepSpeed accepts one string for a one-element list, and drops duplicates keeping order.
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(dict.fromkeys(value))
    return value


#: "auto" or an integer (checked by ZenFlowConfig._auto_or_int; the string is for the docs).
AutoOrInt = Annotated[Any, '"auto" or integer']


class LeafModuleConfig(ConfigModel):
    """Modules fetched as one unit by ZeRO-3 (no hooks on their children)."""

    classes: List[str] = option(
        doc="Fully qualified class names treated as leaf modules.",
        default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES),
        shown_default="Mixtral, Qwen2-MoE and Qwen3-MoE sparse MoE blocks")
    names: List[str] = option(doc="Module names (as in named_modules()) treated as leaves.",
                              default_factory=list)
    name_suffixes: List[str] = option(doc="Module-name suffixes treated as leaves.",
                                      default_factory=list)

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _coerce(cls, value: Any) -> Any:
        return _string_list(value)


class ZenFlowConfig(ConfigModel):
    """ZenFlow: update the most important gradient columns on the accelerator, the rest later
    on the CPU, overlapping the CPU step with compute."""

    topk_ratio: Float = option(0.1, "Fraction of top-k gradient columns kept.", ge=0.0, le=1.0)
    select_strategy: str = option("auto", 'How important columns are re-selected: "auto", '
                                  '"step" or "epoch".')
    select_interval: AutoOrInt = option("auto", "Re-selection interval.")
    update_interval: AutoOrInt = option("auto", "Interval to apply the unimportant gradients.")
    overlap_step: bool = option(False, "Overlap the CPU optimizer step with forward/backward.")
    offload: bool = option(False, "Offload the selective optimizer state to CPU.")
    auto_ratio: Float = option(0.99, 'Threshold of the "auto" strategy.', ge=0.0, le=1.0)
    full_warm_up_rounds: Int = option(0, "Initial rounds with full (unselected) updates.", ge=0)
    pt_reserved_cores_perc: Float = option(
        0.5, "Fraction of CPU cores reserved for PyTorch threads.", ge=0.0, le=1.0)
    steps_per_epoch: Optional[Int] = option(
        None, "Set at run time by the engine; not meant to be written by users.", ge=1)

    @field_validator("select_strategy")
    @classmethod
    def _strategy(cls, value: str) -> str:
        if value not in ("auto", "step", "epoch"):
            raise ValueError('must be "auto", "step" or "epoch"')
        return value

    @field_validator("select_interval", "update_interval")
    @classmethod
    def _auto_or_int(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError('must be "auto" or an integer')
