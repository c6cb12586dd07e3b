"""``fp16``, ``bf16`` (alias ``bfloat16``) and ``data_types``.

Names and defaults follow DeepSpeed's ``deepspeed/runtime/precision_config.py`` and
``runtime/constants.py`` (0.19.x).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import field_validator, model_validator

from .base import ConfigModel, Float, Int, option, rule_error


class FP16Config(ConfigModel):
    """fp16 mixed precision with (dynamic) loss scaling and fp32 master weights."""

    enabled: bool = option(False, "Train with fp16 parameters/gradients and fp32 master weights.")
    auto_cast: bool = option(False, "Cast floating-point inputs of the model to fp16.")
    loss_scale: Float = option(
        0.0, "Static loss scale; 0 selects dynamic loss scaling.", ge=0.0)
    initial_scale_power: Int = option(
        16, "Dynamic scaling starts at 2**initial_scale_power.", ge=0, le=127,
        ds_note="DeepSpeed does not bound it; 2**127 is the largest power of two a float32 "
        "loss scale holds.")
    loss_scale_window: Int = option(
        1000, "Overflow-free steps before the dynamic scale is doubled.")
    hysteresis: Int = option(
        2, "Overflows tolerated before the dynamic scale is lowered.", ge=1)
    consecutive_hysteresis: bool = option(
        False, "Refill the hysteresis on every overflow-free step.")
    min_loss_scale: Int = option(1, "Floor of the dynamic loss scale.")
    fp16_master_weights_and_grads: bool = option(
        False, "Keep master weights and gradients in fp16 (needs CPU offload with the CPU "
        "Adam optimizer).")

    @model_validator(mode="after")
    def _dynamic_scaling_needs_positive_window(self) -> "FP16Config":
        # Only checked when dynamic scaling will actually run, so static-scale configs that
        # carry unused values still load (DeepSpeed does the same).
        if self.enabled and self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise rule_error("loss_scale_window", self.loss_scale_window,
                                 "must be > 0 with dynamic loss scaling (loss_scale 0)")
            if self.min_loss_scale <= 0:
                raise rule_error("min_loss_scale", self.min_loss_scale,
                                 "must be > 0 with dynamic loss scaling (loss_scale 0)")
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when fp16 is on and no static loss scale is given."""
        return self.enabled and self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.initial_scale_power)


class BF16Config(ConfigModel):
    """bf16 mixed precision (no loss scaling)."""

    enabled: bool = option(False, "Train with bf16 parameters/gradients and fp32 master weights.")
    immediate_grad_update: bool = option(
        False, "DeepSpeed's BF16 optimizer (bf16 with data_types.grad_accum_dtype fp32): add each "
        "parameter's bf16 gradient into the fp32 accumulator as soon as its backward produced it, instead of "
        "after the backward.", ds_note="zero_ext folds each backward's bf16 gradients into the fp32 "
        "accumulator at the end of that backward either way: the sums are the same, only the moment "
        "differs, so both values are accepted and train identically.")
    check_grad_overflow: bool = option(
        True, "Skip the step when the gradients overflow (inf/nan); false steps on them (the parameters "
        "become inf/nan).", ds_note="DeepSpeed's default is false (and it checks at stages 1-2 only); "
        "zero_ext checks unless told not to.")
    bf16_master_weights_and_grads: bool = option(
        False, "Keep the master weights and the gradient partitions in bf16 instead of fp32 (ZeRO stages "
        "1-3). Needs bf16_optimizer_states, or offload_optimizer device cpu with the CPU Adam (which "
        "keeps fp32 optimizer states). zero_ext: the master is the parameters' own partition unless "
        "offloaded; NVMe optimizer offload, offload ratio < 1 and Muon are refused (docs/precision.md).")
    bf16_optimizer_states: bool = option(
        False, "Keep optimizer states (Adam's moments) in bf16 (needs bf16_master_weights_and_grads; a "
        "CPU Adam is built with fp32_optimizer_states false, a client's must be).")

    @model_validator(mode="after")
    def _states_need_master(self) -> "BF16Config":
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise rule_error("bf16_optimizer_states", True,
                             "needs bf16.bf16_master_weights_and_grads to be true")
        return self


#: Spellings DeepSpeed's DtypeEnum accepts, mapped to the short names zero_ext stores.
DTYPE_SPELLINGS = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}


def canonical_dtype(value: Any) -> Any:
    """Map a dtype spelling to "fp16" / "bf16" / "fp32"; raise for anything else."""
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in DTYPE_SPELLINGS:
        return DTYPE_SPELLINGS[value.lower()]
    raise ValueError('must be one of "fp16", "bf16", "fp32" (or float16/half/bfloat16/float32)')


class DataTypesConfig(ConfigModel):
    """Data types of gradient accumulation and of parameters/buffers."""

    grad_accum_dtype: Optional[str] = option(
        None, "Dtype gradients are accumulated in (fp16, bf16, fp32); unset: the parameter "
        "dtype. zero_ext: stage 2 accumulates in fp32; stage 1 with bf16 and fp32 adds each micro "
        "step's gradients into a full fp32 buffer reduced in fp32 (DeepSpeed's BF16 optimizer); "
        "any other value than what the stage does is ignored with a warning at stages 1-3 (as "
        "DeepSpeed ignores it) and refused at stage 0.")
    param_dtype: Optional[str] = option(
        None, "Dtype of the model's parameters (fp16, bf16, fp32): they are cast to the fp16/bf16 "
        "mode's dtype, which this must match when set.")
    buffer_dtype: Optional[str] = option(
        None, "Dtype the model's floating-point buffers are cast to (fp16, bf16, fp32); unset: they "
        "keep the dtype they were built in (an fp32 rotary inv_freq stays fp32 under bf16), as in "
        "DeepSpeed 0.19.5+.")

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return canonical_dtype(value)
