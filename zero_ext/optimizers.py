"""The base optimizer: built from the config's ``optimizer`` section, or the client's own.

Adam and AdamW follow DeepSpeed: type "Adam" decouples weight decay (AdamW) unless
``adam_w_mode: false``. Until zero_ext's fused/CPU Adam lands, both run as torch.optim.Adam(W), whose
update is the same math. Other torch.optim names build that class with the given params.
"""
from typing import Any, Dict, List

import torch

from .config import ConfigError

# Adam(W) params that torch.optim takes as they are.
_TORCH_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
                    "differentiable", "fused")


def build_optimizer(opt_cfg, param_groups: List[Dict[str, Any]]) -> torch.optim.Optimizer:
    """The torch optimizer the config's ``optimizer`` section asks for, over ``param_groups``."""
    # DeepSpeed's defaults where the config is silent (its Adam decays 0.0; torch's AdamW 0.01)
    params = opt_cfg.params_with_defaults()
    if opt_cfg.type in ("adam", "adamw"):
        if params.get("bias_correction", True) is False:
            raise ConfigError("optimizer.params.bias_correction = false is not implemented by zero_ext yet "
                              "(torch's Adam always corrects bias); remove the key")
        cls = torch.optim.AdamW if opt_cfg.adam_w_mode else torch.optim.Adam
        kwargs = {k: params[k] for k in _TORCH_ADAM_KEYS if k in params and params[k] is not None}
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        return cls(param_groups, **kwargs)
    if opt_cfg.type == "lion":
        if any(p.is_cuda for g in param_groups for p in g["params"]):
            raise ConfigError("optimizer.type = 'Lion' on CUDA tensors is not implemented by zero_ext yet (its C "
                              "Lion runs on CPU tensors); use AdamW, or train on CPU")
        from .ops.lion import CPULion

        return CPULion(param_groups, **params)
    name = {"adagrad": "Adagrad"}.get(opt_cfg.type, opt_cfg.type)
    cls = getattr(torch.optim, name, None)
    if cls is None:
        raise ConfigError(f"optimizer.type = {opt_cfg.type!r} is not available in this torch "
                          f"({torch.__version__}); choose Adam, AdamW or a torch.optim class")
    try:
        return cls(param_groups, **params)
    except TypeError as exc:
        raise ConfigError(f"optimizer.params do not fit torch.optim.{name}: {exc}") from None
