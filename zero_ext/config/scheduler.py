"""The ``scheduler`` section: ``{"type": ..., "params": {...}}``.

DeepSpeed's five schedulers (``deepspeed/runtime/lr_schedules.py``) get typed params with their
constructor defaults; any other type must be a ``torch.optim.lr_scheduler`` class, whose params
are passed through unchecked (as in DeepSpeed). Names are case-sensitive, as in DeepSpeed.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Dict, List, Optional, Tuple, Type

from pydantic import (AfterValidator, BeforeValidator, ValidationInfo, field_validator,
                      model_validator)

from .base import ConfigModel, Float, Int, option, rule_errors
from .errors import unknown_key_message
from .params import auto_keys_under, check_params


def _per_group_numbers(value: Any, low: float, high: Optional[float], what: str) -> Any:
    # One value, or one per parameter group (DeepSpeed's _format_param takes both; the length is
    # checked against the optimizer's groups when the scheduler is built).
    numbers = value if isinstance(value, (list, tuple)) else [value]
    if not numbers or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in numbers):
        raise ValueError(f"must be {what} or a non-empty list of them (one per parameter group)")
    if not all(math.isfinite(v) for v in numbers):
        raise ValueError("must be finite (not inf or nan)")
    if any(v < low or (high is not None and v >= high) for v in numbers):
        raise ValueError(f"must be >= {low:g}" if high is None else
                         f"must be in [{low:g}, {high:g})")
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else float(value)


def _lr_value(value: Any) -> Any:
    return _per_group_numbers(value, 0.0, None, "a finite number >= 0")


def _momentum_value(value: Any) -> Any:
    return _per_group_numbers(value, 0.0, 1.0, "a number in [0, 1)")


def _warmup_curve(value: str) -> str:
    if value not in ("log", "linear"):
        raise ValueError('must be "log" or "linear"')
    return value


#: A learning rate or a list of them, one per parameter group. (The string is the type as
#: docs/config.md shows it.)
Lr = Annotated[Any, BeforeValidator(_lr_value), "number ≥ 0, or a list of them (one per group)"]
#: Momentum (beta1), one value or one per group: beta1 >= 1 would divide by zero in Adam.
Momentum = Annotated[Any, BeforeValidator(_momentum_value),
                     "number in [0, 1), or a list of them (one per group)"]
WarmupCurve = Annotated[str, AfterValidator(_warmup_curve), '"log" or "linear"']


def _warmup_type() -> Any:
    return option("log", "Warm-up curve: log or linear.")


def _last_batch() -> Any:
    return option(-1, "Index of the last batch when resuming (-1: start).", ge=-1)


class WarmupLRParams(ConfigModel):
    """WarmupLR: rise from warmup_min_lr to warmup_max_lr, then stay."""

    warmup_min_lr: Lr = option(0.0, "Learning rate at step 0.")
    warmup_max_lr: Optional[Lr] = option(None, "Learning rate after warm-up (unset: the "
                                         "optimizer's lr).")
    warmup_num_steps: Int = option(1000, "Warm-up steps.", gt=0)
    warmup_type: WarmupCurve = _warmup_type()
    last_batch_iteration: Int = _last_batch()


class WarmupDecayLRParams(ConfigModel):
    """WarmupDecayLR: warm up, then decay linearly to warmup_min_lr at total_num_steps."""

    total_num_steps: Optional[Int] = option(None, "Total training steps.", gt=0, required=True)
    warmup_min_lr: Lr = option(0.0, "Learning rate at step 0.")
    warmup_max_lr: Lr = option(0.001, "Learning rate after warm-up.")
    warmup_num_steps: Int = option(1000, "Warm-up steps.", gt=0)
    warmup_type: WarmupCurve = _warmup_type()
    last_batch_iteration: Int = _last_batch()


class WarmupCosineLRParams(ConfigModel):
    """WarmupCosineLR: warm up to the optimizer's lr, then cosine decay (ratios of that lr)."""

    total_num_steps: Optional[Int] = option(None, "Total training steps.", gt=0, required=True)
    warmup_min_ratio: Float = option(0.0, "Starting lr as a fraction of the optimizer's lr.",
                                     ge=0.0)
    warmup_num_steps: Int = option(1000, "Warm-up steps.", gt=0)
    cos_min_ratio: Float = option(1e-4, "Final lr as a fraction of the optimizer's lr.",
                                  ge=0.0)
    warmup_type: WarmupCurve = _warmup_type()
    last_batch_iteration: Int = _last_batch()


class OneCycleParams(ConfigModel):
    """OneCycle: 1-cycle policy of lr (and momentum), then decay."""

    cycle_min_lr: Optional[Lr] = option(None, "Lowest lr of the cycle.", required=True)
    cycle_max_lr: Optional[Lr] = option(None, "Highest lr of the cycle.", required=True)
    decay_lr_rate: Float = option(0.0, "lr decay rate after the cycle.", ge=0.0)
    cycle_first_step_size: Int = option(2000, "Steps of the rising half.", gt=0)
    cycle_second_step_size: Optional[Int] = option(None, "Steps of the falling half (unset: "
                                                   "cycle_first_step_size).", gt=0)
    cycle_first_stair_count: Int = option(0, "Stairs in the rising half (0: smooth).", ge=0)
    cycle_second_stair_count: Optional[Int] = option(None, "Stairs in the falling half.", ge=0)
    decay_step_size: Int = option(0, "Steps between decays after the cycle.", ge=0)
    cycle_momentum: bool = option(True, "Also cycle the momentum (beta1).")
    cycle_min_mom: Momentum = option(0.8, "Lowest momentum (one value, or one per param group).")
    cycle_max_mom: Momentum = option(0.9, "Highest momentum (one value, or one per param group).")
    decay_mom_rate: Float = option(0.0, "Momentum decay rate after the cycle.", ge=0.0)
    last_batch_iteration: Int = _last_batch()


class LRRangeTestParams(ConfigModel):
    """LRRangeTest: grow the lr from lr_range_test_min_lr to find a good range."""

    lr_range_test_min_lr: Lr = option(1e-3, "Starting learning rate.")
    lr_range_test_step_size: Int = option(2000, "Steps between lr increases.", gt=0)
    lr_range_test_step_rate: Float = option(1.0, "lr growth per step_size.", ge=0.0)
    lr_range_test_staircase: bool = option(False, "Grow in stairs instead of continuously.")
    last_batch_iteration: Int = _last_batch()


#: DeepSpeed's schedulers and the models of their params.
DEEPSPEED_SCHEDULERS: Dict[str, Type[ConfigModel]] = {
    "LRRangeTest": LRRangeTestParams,
    "OneCycle": OneCycleParams,
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}
#: torch.optim.lr_scheduler classes DeepSpeed falls back to (params not checked).
TORCH_SCHEDULERS = ("ChainedScheduler", "ConstantLR", "CosineAnnealingLR",
                    "CosineAnnealingWarmRestarts", "CyclicLR", "ExponentialLR", "LambdaLR",
                    "LinearLR", "MultiStepLR", "MultiplicativeLR", "OneCycleLR", "PolynomialLR",
                    "ReduceLROnPlateau", "SequentialLR", "StepLR")


class SchedulerConfig(ConfigModel):
    """Learning-rate scheduler built by ``initialize``; stepped once per applied optimizer
    step (not on fp16-overflow steps)."""

    type: str = option(..., "Scheduler name: WarmupLR, WarmupDecayLR, WarmupCosineLR, "
                       "OneCycle, LRRangeTest, or a torch.optim.lr_scheduler class name.")
    params: Dict[str, Any] = option(doc="Keyword arguments of the scheduler (see below).",
                                    default_factory=dict, auto_inside=True)

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str) -> str:
        if name in DEEPSPEED_SCHEDULERS or name in TORCH_SCHEDULERS:
            return name
        names = list(DEEPSPEED_SCHEDULERS) + list(TORCH_SCHEDULERS)
        raise ValueError(unknown_key_message(name, names, "scheduler types")
                         .replace("unknown key", "unknown type"))

    @model_validator(mode="after")
    def _check_params(self, info: ValidationInfo) -> "SchedulerConfig":
        model = DEEPSPEED_SCHEDULERS.get(self.type)
        if model is None:
            return self
        auto = auto_keys_under(info.context, "scheduler.params")
        clean, problems = check_params(model, self.params, self.type, auto)
        if problems:
            raise rule_errors(problems)
        self.__dict__["params"] = clean
        return self

    @property
    def params_model(self) -> Optional[Type[ConfigModel]]:
        """The typed params of a DeepSpeed scheduler (None for torch schedulers)."""
        return DEEPSPEED_SCHEDULERS.get(self.type)


def scheduler_param_tables() -> List[Tuple[str, Type[ConfigModel]]]:
    """(type name, params model) pairs, for docs."""
    return list(DEEPSPEED_SCHEDULERS.items())
