"""``bf16.bf16_master_weights_and_grads`` and ``bf16.bf16_optimizer_states``: the master dtype, and
DeepSpeed's rules for when they may be used.

With ``bf16_master_weights_and_grads`` the master partitions and the gradient partitions the reducer
accumulates into are bf16 instead of fp32 (FlatGroup / ShardGroup take ``master_dtype``). The model is
bf16 too, so the master *is* the parameters' partition (stages 1-2) or the pieces (stage 3) — no copy,
as an fp32 model's master is its parameters — unless the optimizer is offloaded, where it is a host
tensor of its own. Gradients are reduced, accumulated over micro steps, unscaled and clipped in bf16,
as in DeepSpeed (its stage_1_and_2.py / stage3.py keep ``master_weights_and_grads_dtype`` partitions).

The optimizer state's dtype is the optimizer's business, as in DeepSpeed:
- ``bf16_optimizer_states: true``: torch's optimizers make their state like the (bf16) master; zero_ext's
  C optimizers are told ``fp32_optimizer_states = False`` (a config-built one with a warning if its params
  said true; a client's must have been built so).
- ``bf16_optimizer_states: false``: the states stay fp32, which DeepSpeed allows only where its CPU Adam
  keeps them — with ``offload_optimizer`` — and zero_ext's CPU Adam upcasts the bf16 master and
  gradient to fp32 for the update and rounds the new master to bf16, as DeepSpeed's does.

DeepSpeed's rules (base_optimizer.py ``_configure_master_weights``, config.py): stages 1-3 only (checked
when the config loads), optimizer states need the master flag, and the master flag needs ZeRO-Offload with
the CPU Adam unless the states are bf16 and nothing is offloaded. zero_ext adds the combinations it does
not implement: NVMe optimizer offload, a partial ``ratio``, Muon.
"""
import logging

import torch

from ..config import ConfigError
from ..config.errors import ClientOptimizerError, UnimplementedFeatureError
from ..ops.adam import CPUAdam
from ..ops._optimizer import CPUOptimizer

logger = logging.getLogger("zero_ext")

_KEY = "bf16.bf16_master_weights_and_grads"
_STATES = "bf16.bf16_optimizer_states"


def master_dtype(cfg) -> torch.dtype:
    """The dtype of the master partitions and gradient partitions: bf16 with the flag, else fp32."""
    return torch.bfloat16 if cfg.bf16.bf16_master_weights_and_grads else torch.float32


def check_config(cfg, plan) -> None:
    """The rules that need only the config and the offload plan (before anything is built)."""
    bf = cfg.bf16
    if not bf.bf16_master_weights_and_grads:
        return
    if not bf.enabled:
        raise ConfigError(f"{_KEY} = true keeps bf16 masters of a bf16 model, but bf16.enabled is false; set "
                          "bf16.enabled to true, or remove the key")
    if plan.optimizer_device == "nvme":
        raise UnimplementedFeatureError(
            f"{_KEY} = true with offload_optimizer.device 'nvme' is not implemented by zero_ext yet (its NVMe "
            "swap files hold fp32 masters); use offload_optimizer.device 'cpu'")
    if plan.optimizer and plan.ratio < 1.0:
        raise UnimplementedFeatureError(
            f"{_KEY} = true with offload_optimizer.ratio < 1 is not implemented by zero_ext yet; set ratio to 1")
    if cfg.optimizer is not None and cfg.optimizer.type == "muon":
        raise UnimplementedFeatureError(f"{_KEY} = true with the Muon optimizer is not implemented by zero_ext "
                                        "yet; use Adam/AdamW")
    if not bf.bf16_optimizer_states and not plan.optimizer:
        raise ConfigError(
            f"{_KEY} = true with fp32 optimizer states needs ZeRO-Offload (DeepSpeed's rule: the CPU Adam "
            f"keeps fp32 states beside the bf16 masters): set {_STATES} to true to keep the states in bf16 on "
            "the device, or set zero_optimization.offload_optimizer.device to 'cpu'")


def check_base(cfg, base: torch.optim.Optimizer, plan, client: bool) -> None:
    """The rules on the base optimizer: ZeRO-Offload steps with the CPU Adam, and bf16 optimizer states
    need a C optimizer that keeps them in bf16 (a config-built one is set so)."""
    bf = cfg.bf16
    if not bf.bf16_master_weights_and_grads:
        return
    name = type(base).__name__
    if plan.optimizer and not isinstance(base, CPUAdam):
        fix = ("pass zero_ext.ops.adam.CPUAdam (DeepSpeedCPUAdam)" if client else
               "use optimizer type Adam/AdamW without params.torch_adam")
        raise ClientOptimizerError(
            f"{_KEY} = true with ZeRO-Offload needs the CPU Adam (DeepSpeedCPUAdam), as in DeepSpeed; the "
            f"optimizer is {name}: {fix}")
    if not bf.bf16_optimizer_states or not isinstance(base, CPUOptimizer) or not base.fp32_optimizer_states:
        return
    if client:
        raise ClientOptimizerError(
            f"{_STATES} = true: the client {name} was built with fp32_optimizer_states=True, which keeps fp32 "
            f"moments; build it with fp32_optimizer_states=False so optimizer moments are stored in bf16")
    if cfg.optimizer is not None and "fp32_optimizer_states" in cfg.optimizer.params:
        logger.warning("%s is enabled; overriding optimizer.params.fp32_optimizer_states to false so the CPU "
                       "optimizer's states are stored in bf16", _STATES)
    base.fp32_optimizer_states = False
