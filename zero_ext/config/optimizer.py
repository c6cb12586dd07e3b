"""The ``optimizer`` section: ``{"type": ..., "params": {...}}``.

Type names follow DeepSpeed's ``engine._configure_basic_optimizer``: its own names are
case-insensitive and stored lower-case (``"AdamW"`` -> ``"adamw"``); any other name must be a
``torch.optim`` class (case-sensitive). For Adam/AdamW the params are checked against what
DeepSpeed's FusedAdam / DeepSpeedCPUAdam / torch.optim.Adam(W) accept.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from pydantic import ValidationInfo, field_validator, model_validator

from .base import ConfigModel, Float, option, rule_errors
from .errors import ConfigWarning, unknown_key_message, warn
from .optim_params import AdagradParams, LionParams, MuonParams, betas_in_range, torch_optimizer_problems
from .params import auto_keys_under, check_params

#: Typed params of DeepSpeed's own optimizer names besides Adam/AdamW.
TYPED_PARAMS = {"adagrad": AdagradParams, "lion": LionParams, "muon": MuonParams}

#: DeepSpeed's own optimizer names (matched case-insensitively).
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "onebitadam", "zerooneadam",
                        "onebitlamb", "muadam", "muadamw", "musgd", "lion", "muon")
#: Optimizers DeepSpeed refuses to combine with ZeRO (stage >= 1).
NOT_WITH_ZERO = ("onebitadam", "zerooneadam", "onebitlamb")
#: torch.optim classes DeepSpeed falls back to for other names (matched case-sensitively).
TORCH_OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax",
                    "LBFGS", "Muon", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam")
#: torch.optim.Adam(W) keyword arguments DeepSpeed's fused/CPU Adam do not take.
TORCH_ONLY_ADAM_ARGS = ("foreach", "maximize", "capturable", "differentiable", "fused")


class AdamParams(ConfigModel):
    """Parameters of ``"type": "Adam"`` / ``"AdamW"``."""

    lr: Float = option(1e-3, "Learning rate.", ge=0.0)
    betas: Tuple[Float, Float] = option((0.9, 0.999), "Coefficients of the running averages "
                                        "of the gradient and its square.")
    eps: Float = option(1e-8, "Term added to the denominator for stability.", gt=0.0)
    weight_decay: Float = option(0.0, "Weight decay (decoupled in AdamW mode).", ge=0.0)
    bias_correction: bool = option(True, "Apply Adam's bias correction.")
    amsgrad: bool = option(False, "AMSGrad variant (only with torch_adam).")
    adam_w_mode: bool = option(
        True, 'Decoupled weight decay. Note: with the default true, "type": "Adam" behaves as '
        "AdamW, as in DeepSpeed; set false for classic Adam.")
    torch_adam: bool = option(False, "Use torch.optim.Adam/AdamW instead of DeepSpeed's "
                              "fused/CPU implementation.")
    fp32_optimizer_states: bool = option(True, "CPU Adam: keep optimizer states in fp32.")
    set_grad_none: bool = option(True, "Fused Adam: set gradients to None in zero_grad().")
    foreach: Optional[bool] = option(None, "torch_adam only: torch's foreach implementation.")
    maximize: Optional[bool] = option(None, "torch_adam only: maximise the objective.")
    capturable: Optional[bool] = option(None, "torch_adam only: CUDA-graph capturable.")
    differentiable: Optional[bool] = option(None, "torch_adam only: differentiable step.")
    fused: Optional[bool] = option(None, "torch_adam only: torch's fused implementation.")

    _betas_in_range = field_validator("betas")(classmethod(lambda cls, betas: betas_in_range(betas)))


def _adam_rules(given: Dict[str, Any]) -> List[Tuple[str, Any, str]]:
    problems = []
    torch_adam = given.get("torch_adam", False)
    if given.get("amsgrad") and not torch_adam:
        problems.append(("params.amsgrad", True, "DeepSpeed's fused/CPU Adam has no AMSGrad; "
                         "set params.torch_adam to true to use torch.optim's"))
    for key in TORCH_ONLY_ADAM_ARGS:
        if key in given and not torch_adam:
            problems.append((f"params.{key}", given[key],
                             "is a torch.optim.Adam(W) argument; it needs params.torch_adam true"))
    if torch_adam and "set_grad_none" in given:
        problems.append(("params.set_grad_none", given["set_grad_none"],
                         "is an argument of DeepSpeed's fused Adam, not of torch.optim.Adam(W)"))
    return problems


def canonical_optimizer_type(name: str) -> str:
    """DeepSpeed names lower-cased, torch.optim names as written; ValueError otherwise."""
    if name.lower() in DEEPSPEED_OPTIMIZERS:
        return name.lower()
    if name in TORCH_OPTIMIZERS:
        return name
    raise ValueError(unknown_key_message(name, DEEPSPEED_OPTIMIZERS + TORCH_OPTIMIZERS,
                                         "optimizer types").replace("unknown key", "unknown type"))


class OptimizerConfig(ConfigModel):
    """Optimizer built by ``initialize`` when the user passes none."""

    type: str = option(..., "Optimizer name: Adam, AdamW, Adagrad, Lamb, Lion, Muon, ... "
                       "(DeepSpeed's, case-insensitive) or a torch.optim class name.")
    params: Dict[str, Any] = option(
        doc="Keyword arguments of the optimizer (for Adam/AdamW see optimizer.params below).",
        default_factory=dict, auto_inside=True)
    legacy_fusion: bool = option(False, "Legacy fused fp16 optimizer wrapper (DeepSpeed "
                                 "FP16_Optimizer option).")
    torch_adam: Optional[bool] = option(
        None, "Ignored with a warning: torch_adam is read from optimizer.params. DeepSpeed ignores "
        "it here too (its own tests write it here).")

    @field_validator("type")
    @classmethod
    def _known_type(cls, name: str) -> str:
        return canonical_optimizer_type(name)

    @model_validator(mode="after")
    def _check_params(self, info: ValidationInfo) -> "OptimizerConfig":
        problems: List[Tuple[str, Any, str]] = []
        if self.torch_adam is not None:
            warn(f"optimizer.torch_adam = {self.torch_adam!r} is ignored: torch_adam is read from "
                 "optimizer.params (DeepSpeed ignores it here too); move it into params", ConfigWarning)
        if "max_grad_norm" in self.params:
            problems.append(("params.max_grad_norm", self.params["max_grad_norm"],
                             "is not an optimizer parameter: use the top-level "
                             "\"gradient_clipping\" key instead"))
        if self.type in ("adam", "adamw"):
            given = {k: v for k, v in self.params.items() if k != "max_grad_norm"}
            auto = auto_keys_under(info.context, "optimizer.params")
            clean, found = check_params(AdamParams, given, self.type, auto)
            problems += found or _adam_rules(clean)
            if not found:
                self.__dict__["params"] = clean
        elif self.type in TYPED_PARAMS:
            given = {k: v for k, v in self.params.items() if k != "max_grad_norm"}
            auto = auto_keys_under(info.context, "optimizer.params")
            clean, found = check_params(TYPED_PARAMS[self.type], given, self.type, auto)
            problems += found
            if not found:
                self.__dict__["params"] = clean
        elif self.type in TORCH_OPTIMIZERS:
            given = {k: v for k, v in self.params.items() if k != "max_grad_norm"}
            clean, found = torch_optimizer_problems(self.type, given)
            problems += found
            if not found:
                self.__dict__["params"] = clean
        if problems:
            raise rule_errors(problems)
        return self

    def params_with_defaults(self) -> Dict[str, Any]:
        """For Adam/AdamW: every parameter, DeepSpeed's default where not given (e.g.
        weight_decay 0.0, where torch.optim.AdamW would default to 0.01); torch-only arguments
        left unset are omitted. Other types: the params as given."""
        if not self.is_adam:
            return dict(self.params)
        merged = {**AdamParams().model_dump(), **self.params}
        return {k: v for k, v in merged.items() if v is not None}

    @property
    def is_adam(self) -> bool:
        """Adam or AdamW (the optimizers zero_ext's CPU/fused paths implement)."""
        return self.type in ("adam", "adamw")

    @property
    def adam_w_mode(self) -> bool:
        """Whether weight decay is decoupled: always for AdamW; for Adam unless the params say
        ``adam_w_mode: false`` (DeepSpeed's default makes "Adam" behave as AdamW)."""
        return self.type == "adamw" or bool(self.params.get("adam_w_mode", True))
