"""Batch-size arithmetic: train_batch_size = micro_batch_per_gpu * grad_accum_steps * world_size.

Any two of the three derive the third, as in DeepSpeed's ``_set_batch_related_parameters``;
one alone fixes the others (gradient_accumulation_steps = 1). DeepSpeed derives with floor
division and then fails a generic equality assertion; here a non-divisible input is reported
with the division that failed.

"auto" (HF Trainer) for a batch key means "derive it". When neither train_batch_size nor the
micro batch size is given but one of them was "auto", the micro batch size is 1, which is what
HF Accelerate substitutes before handing such a config to DeepSpeed.
"""

from __future__ import annotations

from typing import Collection, Optional, Tuple

from .base import INT64_MAX
from .errors import MISSING, ConfigError, Problem

TRAIN, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", \
    "gradient_accumulation_steps"
BATCH_KEYS = (TRAIN, MICRO, GAS)

Triple = Tuple[int, int, int]


def _divide(total: int, total_name: str, parts: Tuple[Tuple[str, int], ...]) -> int:
    divisor = 1
    for _, value in parts:
        divisor *= value
    if total % divisor:
        shown = " * ".join(f"{name} ({value})" for name, value in parts)
        raise ConfigError(f"must be divisible by {shown} = {divisor}", path=total_name,
                          value=total)
    return total // divisor


def resolve_batch(train: Optional[int], micro: Optional[int], gas: Optional[int],
                  world_size: int, auto: Collection[str] = ()) -> Triple:
    """Return (train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps).

    ``None`` means "not given"; ``auto`` names the keys that were "auto". Raises ConfigError.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("the data-parallel world size must be an integer >= 1",
                          path="world_size", value=world_size)
    if train is None and micro is None:
        if not {TRAIN, MICRO} & set(auto):
            raise ConfigError(f"give {TRAIN} or {MICRO} (or both): {GAS} alone does not fix "
                              "the batch size", path=TRAIN, value=MISSING)
        micro = 1
    ws = ("world_size", world_size)
    if train is not None and micro is not None and gas is None:
        gas = _divide(train, TRAIN, ((MICRO, micro), ws))
    elif train is not None and gas is not None and micro is None:
        micro = _divide(train, TRAIN, ((GAS, gas), ws))
    elif train is not None and micro is None:
        gas, micro = 1, _divide(train, TRAIN, (ws,))
    elif micro is not None and train is None:
        gas = 1 if gas is None else gas
        train = micro * gas * world_size
        if train > INT64_MAX:
            raise ConfigError(
                f"{MICRO} ({micro}) * {GAS} ({gas}) * world_size ({world_size}) = {train} does not "
                "fit a signed 64-bit integer; lower them", path=TRAIN, value=MISSING)
    if train != micro * gas * world_size:
        raise ConfigError(
            f"{TRAIN} must equal {MICRO} * {GAS} * world_size, but {train} != "
            f"{micro} * {gas} * {world_size} = {micro * gas * world_size}; fix one of the three "
            "(or leave one out to derive it)", path=TRAIN, value=train)
    return train, micro, gas


def check_batch_without_world_size(train: Optional[int], micro: Optional[int],
                                   gas: Optional[int]) -> Optional[Problem]:
    """Before the world size is known: the given numbers must allow *some* world size."""
    if train is None:
        return None
    divisor = (micro or 1) * (gas or 1)
    if train % divisor == 0:
        return None
    shown = " * ".join(f"{name} ({value})" for name, value in ((MICRO, micro), (GAS, gas))
                       if value is not None)
    return Problem(TRAIN, train, f"must be a multiple of {shown} = {divisor} (it equals "
                   f"{MICRO} * {GAS} * world_size)")
