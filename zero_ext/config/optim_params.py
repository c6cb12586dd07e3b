"""``optimizer.params`` of the types other than Adam/AdamW: Adagrad, Lion and torch.optim classes.

What the engine builds decides which keys exist (zero_ext/optim/factory.py, as DeepSpeed's
``_configure_basic_optimizer``): Adagrad is ``torch.optim.Adagrad`` on the accelerator and the C
``CPUAdagrad`` with optimizer offload; Lion is always the C ``CPULion``; any other torch.optim name
is that class, built with the params as keyword arguments. A key that constructor does not take
would be a ``TypeError`` at ``initialize``; here it is an error at load, with a suggestion.

The keys of a torch.optim class are read from its ``__init__`` signature (torch is imported only
then, so loading a config without such an optimizer stays torch-free); their values are checked by
name (learning rates, betas, eps, ...) and by the type of the constructor's default.
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any, Dict, List, Optional, Tuple

from pydantic import field_validator

from .base import ConfigModel, Float, option
from .errors import unknown_key_message

ProblemTuple = Tuple[str, Any, str]


class AdagradParams(ConfigModel):
    """Parameters of ``"type": "Adagrad"`` (torch.optim.Adagrad, or CPUAdagrad with offload)."""

    lr: Float = option(1e-2, "Learning rate.", ge=0.0)
    eps: Float = option(1e-10, "Term added to the denominator for stability.", gt=0.0)
    weight_decay: Float = option(0.0, "Weight decay (L2 penalty).", ge=0.0)
    lr_decay: Float = option(0.0, "torch only (not with offload): learning-rate decay.", ge=0.0)
    initial_accumulator_value: Float = option(
        0.0, "torch only (not with offload): starting value of the squared-gradient sum.", ge=0.0)
    amsgrad: bool = option(False, "Offload (CPUAdagrad) only: accepted and ignored, as in "
                           "DeepSpeed's CPU Adagrad.")
    fp32_optimizer_states: bool = option(True, "Offload (CPUAdagrad) only: keep the state in "
                                         "fp32.")
    foreach: Optional[bool] = option(None, "torch only: torch's foreach implementation.")
    maximize: Optional[bool] = option(None, "torch only: maximise the objective.")
    differentiable: Optional[bool] = option(None, "torch only: differentiable step.")
    fused: Optional[bool] = option(None, "torch only: torch's fused implementation.")


#: Adagrad keys only one of its two implementations takes.
ADAGRAD_TORCH_ONLY = ("lr_decay", "initial_accumulator_value", "foreach", "maximize",
                      "differentiable", "fused")
ADAGRAD_OFFLOAD_ONLY = ("amsgrad", "fp32_optimizer_states")


class LionParams(ConfigModel):
    """Parameters of ``"type": "Lion"`` (the C CPULion)."""

    lr: Float = option(1e-3, "Learning rate.", ge=0.0)
    betas: Tuple[Float, Float] = option((0.9, 0.99), "Interpolation and running-average "
                                        "coefficients, each in [0, 1).")
    weight_decay: Float = option(0.0, "Decoupled weight decay.", ge=0.0)
    fp32_optimizer_states: bool = option(True, "Keep the momentum in fp32.")

    _betas_in_range = field_validator("betas")(classmethod(lambda cls, betas: betas_in_range(betas)))


class MuonParams(ConfigModel):
    """Parameters of ``"type": "Muon"`` (DeepSpeed's MuonWithAuxAdam): Muon steps the trainable
    parameters of two or more dimensions outside embeddings and lm_head, an auxiliary Adam the rest.
    Unset keys take the group defaults (Muon: lr 0.02, momentum 0.95; Adam: lr 3e-4, betas (0.9, 0.95),
    eps 1e-10; weight decay 0)."""

    lr: Optional[Float] = option(None, "Learning rate of both groups (unless muon_lr / adam_lr).", ge=0.0)
    muon_lr: Optional[Float] = option(None, "Learning rate of the Muon group.", ge=0.0)
    adam_lr: Optional[Float] = option(None, "Learning rate of the Adam group.", ge=0.0)
    momentum: Optional[Float] = option(None, "Muon's (Nesterov) momentum factor, in [0, 1).", ge=0.0)
    weight_decay: Optional[Float] = option(None, "Decoupled weight decay of both groups.", ge=0.0)
    betas: Optional[Tuple[Float, Float]] = option(None, "The Adam group's betas, each in [0, 1).")
    eps: Optional[Float] = option(None, "The Adam group's eps (added outside the square root).", gt=0.0)
    ns_method: Optional[str] = option(None, 'Newton-Schulz variant: "gram" (default) or "standard".')

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas):
        return None if betas is None else betas_in_range(betas)

    @field_validator("momentum")
    @classmethod
    def _momentum(cls, value):
        if value is not None and not value < 1.0:
            raise ValueError("must be in [0, 1)")
        return value

    @field_validator("ns_method")
    @classmethod
    def _ns_method(cls, value):
        if value is not None and value not in ("gram", "standard"):
            raise ValueError('must be "gram" or "standard"')
        return value


def betas_in_range(betas: Tuple[float, float]) -> Tuple[float, float]:
    """Adam's and Lion's betas: each in [0, 1)."""
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError("both betas must be in [0, 1)")
    return betas


def adagrad_rules(given: Dict[str, Any], offloaded: bool) -> List[ProblemTuple]:
    """Keys of the implementation not chosen (the optimizer-offload setting picks it)."""
    if offloaded:
        return [(f"params.{k}", given[k], "is a torch.optim.Adagrad argument; with "
                 "zero_optimization.offload_optimizer the engine builds CPUAdagrad, which does "
                 "not take it") for k in ADAGRAD_TORCH_ONLY if k in given]
    return [(f"params.{k}", given[k], "is an argument of the offloaded CPUAdagrad; without "
             "zero_optimization.offload_optimizer the engine builds torch.optim.Adagrad, which "
             "does not take it") for k in ADAGRAD_OFFLOAD_ONLY if k in given]


# -- torch.optim classes by name ----------------------------------------------------------------

#: Ranges by parameter name: (low, low inclusive, high, high inclusive).
_RANGES = {
    "lr": (0.0, True, None, False),
    "eps": (0.0, False, None, False),
    "weight_decay": (0.0, True, None, False),
    "momentum": (0.0, True, None, False),
    "dampening": (0.0, True, None, False),
    "lr_decay": (0.0, True, None, False),
    "initial_accumulator_value": (0.0, True, None, False),
    "rho": (0.0, True, 1.0, True),
    "alpha": (0.0, True, None, False),
    "lambd": (0.0, True, None, False),
    "momentum_decay": (0.0, True, None, False),
    "betas": (0.0, True, 1.0, False),
}
#: Keys whose constructor default is an int but that take any number.
_REAL_WITH_INT_DEFAULT = ("lr", "weight_decay", "momentum", "dampening", "lr_decay",
                          "initial_accumulator_value")
#: Keys defaulting to None, and the type they take.
_OPTIONAL_TYPES = {"foreach": bool, "fused": bool, "max_eval": int, "line_search_fn": str,
                   "capturable": bool, "differentiable": bool, "maximize": bool}


def torch_optimizer_keys(name: str) -> Optional[Dict[str, Any]]:
    """Keyword arguments of ``torch.optim.<name>`` and their defaults (None when torch or the
    class is not available: the params are then left for the engine)."""
    try:
        cls = getattr(importlib.import_module("torch.optim"), name, None)
    except ImportError:
        return None
    if cls is None:
        return None
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, params
    return {p.name: p.default for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _range_problem(key: str, value: float) -> Optional[str]:
    if not math.isfinite(value):
        return "must be finite (not inf or nan)"
    bounds = _RANGES.get(key)
    if bounds is None:
        return None
    low, low_in, high, high_in = bounds
    ok = (value >= low if low_in else value > low) and (
        high is None or (value <= high if high_in else value < high))
    if ok:
        return None
    left, right = "[" if low_in else "(", "]" if high_in else ")"
    return (f"must be in {left}{low:g}, {'inf' if high is None else f'{high:g}'}{right}"
            if high is not None else f"must be {'>=' if low_in else '>'} {low:g}")


def _check_value(key: str, value: Any, default: Any) -> Optional[str]:
    """What is wrong with ``value`` for a torch.optim argument ``key`` (None: fine)."""
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(default):
            return f"must be a list of {len(default)} numbers"
        for d, v in zip(default, value):
            if v is None and d is None:
                continue
            if not _is_number(v):
                return f"must be a list of {len(default)} numbers"
            bad = _range_problem(key, v)
            if bad:
                return bad.replace("must be", "each must be", 1)
        return None
    if _is_number(default) or default is inspect.Parameter.empty or key in _RANGES:
        if not _is_number(value):
            return "must be a number"
        if isinstance(default, int) and not isinstance(default, bool) \
                and key not in _REAL_WITH_INT_DEFAULT \
                and not float(value).is_integer():
            return "must be an integer"
        return _range_problem(key, value)
    want = _OPTIONAL_TYPES.get(key)
    if isinstance(value, float) and not math.isfinite(value):
        return "must be finite (not inf or nan)"
    if value is None or want is None:
        return None
    if want is bool and not isinstance(value, bool):
        return "must be true, false or null"
    if want is int and not (_is_number(value) and float(value).is_integer()):
        return "must be an integer or null"
    if want is str and not isinstance(value, str):
        return "must be a string or null"
    return None


def torch_optimizer_problems(name: str, params: Dict[str, Any]
                             ) -> Tuple[Dict[str, Any], List[ProblemTuple]]:
    """``params`` for ``torch.optim.<name>`` (integral floats of integer arguments made ints) and
    their problems: unknown keys, wrong values."""
    keys = torch_optimizer_keys(name)
    if keys is None:
        return dict(params), []
    clean = dict(params)
    problems: List[ProblemTuple] = []
    for key, value in params.items():
        if key not in keys:
            problems.append((f"params.{key}", value,
                             unknown_key_message(str(key), list(keys),
                                                 f"torch.optim.{name} params")))
            continue
        bad = _check_value(key, value, keys[key])
        if bad:
            problems.append((f"params.{key}", value, bad))
        elif isinstance(value, float) and value.is_integer() and _wants_int(key, keys[key]):
            clean[key] = int(value)
    return clean, problems


def _wants_int(key: str, default: Any) -> bool:
    return (isinstance(default, int) and not isinstance(default, bool)
            and key not in _REAL_WITH_INT_DEFAULT) or _OPTIONAL_TYPES.get(key) is int
