"""The base optimizer: built from the config's ``optimizer`` section, or checked when it is the client's.

:func:`build_optimizer` follows DeepSpeed's ``_configure_basic_optimizer``:
- Adam / AdamW (type "Adam" decouples weight decay unless ``adam_w_mode: false``): without optimizer
  offload, FusedAdam (ops/fused_adam.py: zero_ext's C kernel on host tensors, torch's fused kernel on
  accelerator tensors); with offload, the C CPUAdam (DeepSpeedCPUAdam); ``torch_adam: true`` keeps
  torch.optim.Adam(W), with bf16 masters (bf16_master.py) on CUDA its fused kernel (fp32 math, one
  rounding) unless the params pick one.
- others, by where the tensors they step live: on host tensors (optimizer offload, or a CPU run) the C
  Adagrad (CPUAdagrad) and Lion (CPULion), unless an Adagrad section gives a torch-only argument
  (lr_decay, initial_accumulator_value, ...) the kernel does not have; on accelerator tensors torch.optim
  (other names build that class with the given params; Lion has only the C kernel, so it refuses them).
:func:`check_client_optimizer` is DeepSpeed's rule for a client optimizer with offload
(``zero_force_ds_cpu_optimizer``).
"""
from typing import Any, Dict, List, Optional

import torch

from ..config import ConfigError
from ..config.errors import ClientOptimizerError, InitializeArgumentError
from ..config.optim_params import ADAGRAD_TORCH_ONLY
from ..ops._optimizer import CPUOptimizer
from ..ops.adagrad import CPUAdagrad
from ..ops.adam import CPUAdam
from ..ops.fused_adam import FusedAdam
from ..ops.lion import CPULion
from ..ops.torch_stepped import TorchStepped

# Adam(W) params that torch.optim takes as they are.
_TORCH_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
                    "differentiable", "fused")


def build_optimizer(opt_cfg, param_groups: List[Dict[str, Any]], offloaded: bool = False,
                    nvme: bool = False, bf16_master: bool = False) -> torch.optim.Optimizer:
    """The optimizer the config's ``optimizer`` section asks for, over ``param_groups``; ``offloaded``:
    the engine steps host copies of them (optimizer offload), wherever the parameters are; ``nvme``: the
    offload goes to NVMe, whose streamed step takes torch_adam's Adam(W) as TorchStepped; ``bf16_master``:
    it will step bf16 masters (optim/bf16_master.py)."""
    if opt_cfg.is_adam and not opt_cfg.params_with_defaults().get("torch_adam"):
        return _adam(opt_cfg, param_groups, offloaded)
    on_host = offloaded or all(p.device.type == "cpu" for g in param_groups for p in g["params"])
    base = _c_optimizer(opt_cfg, param_groups) if on_host else None
    if base is None:
        base = _torch_optimizer(opt_cfg, param_groups, bf16_master)
        if nvme and type(base) in (torch.optim.Adam, torch.optim.AdamW):
            base = TorchStepped(base)
    return base


def _adam(opt_cfg, param_groups: List[Dict[str, Any]], offloaded: bool) -> CPUAdam:
    """DeepSpeed's choice for an Adam/AdamW section without torch_adam: with optimizer offload its CPU Adam
    (CPUAdam), else its FusedAdam (the same C kernel on host tensors, torch's fused kernel on accelerator
    tensors)."""
    params = opt_cfg.params_with_defaults()
    shared = dict(lr=params["lr"], bias_correction=params["bias_correction"], betas=tuple(params["betas"]),
                  eps=params["eps"], weight_decay=params["weight_decay"],
                  fp32_optimizer_states=params["fp32_optimizer_states"])
    if offloaded:
        return CPUAdam(param_groups, adamw_mode=opt_cfg.adam_w_mode, **shared)
    return FusedAdam(param_groups, adam_w_mode=opt_cfg.adam_w_mode, set_grad_none=params["set_grad_none"], **shared)


def _c_optimizer(opt_cfg, param_groups: List[Dict[str, Any]]) -> Optional[CPUOptimizer]:
    """zero_ext's C optimizer for a section other than Adam/AdamW (those: _adam), or None when it asks for
    torch's (a torch-only Adagrad argument, another torch.optim class)."""
    params = opt_cfg.params_with_defaults()
    if opt_cfg.type == "adagrad":
        if any(k in params for k in ADAGRAD_TORCH_ONLY):
            return None
        return CPUAdagrad(param_groups, **params)
    if opt_cfg.type == "lion":
        return CPULion(param_groups, **params)
    return None


def _torch_optimizer(opt_cfg, param_groups: List[Dict[str, Any]], bf16_master: bool = False) -> torch.optim.Optimizer:
    # DeepSpeed's defaults where the config is silent (its Adam decays 0.0; torch's AdamW 0.01)
    params = opt_cfg.params_with_defaults()
    if opt_cfg.is_adam and bf16_master and not any(k in params for k in ("fused", "foreach")) and \
            all(p.is_cuda for g in param_groups for p in g["params"]):
        # bf16 masters: torch's fused kernel computes the update in fp32 and rounds once, as DeepSpeed's
        # FusedAdam does; the foreach one would round every intermediate to bf16
        params = {**params, "fused": True}
    if opt_cfg.is_adam:
        if params.get("bias_correction", True) is False:
            raise ConfigError("optimizer.params.bias_correction = false is not implemented by torch.optim's Adam "
                              "(it always corrects bias); remove the key, or drop torch_adam to use zero_ext's "
                              "CPU Adam, which takes it")
        cls = torch.optim.AdamW if opt_cfg.adam_w_mode else torch.optim.Adam
        kwargs = {k: params[k] for k in _TORCH_ADAM_KEYS if k in params and params[k] is not None}
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        return cls(param_groups, **kwargs)
    if opt_cfg.type == "lion":
        raise ConfigError("optimizer.type = 'Lion' on accelerator tensors is not implemented by zero_ext yet "
                          "(its C Lion runs on CPU tensors); use AdamW, offload the optimizer, or train on CPU")
    name = {"adagrad": "Adagrad"}.get(opt_cfg.type, opt_cfg.type)
    cls = getattr(torch.optim, name, None)
    if cls is None:
        raise ConfigError(f"optimizer.type = {opt_cfg.type!r} is not available in this torch "
                          f"({torch.__version__}); choose Adam, AdamW or a torch.optim class")
    try:
        return cls(param_groups, **params)
    except TypeError as exc:
        raise ConfigError(f"optimizer.params do not fit torch.optim.{name}: {exc}") from None


# Optimizers that step host tensors in C (their class names; DeepSpeed's aliases included).
CPU_OPTIMIZERS = ("CPUAdam", "DeepSpeedCPUAdam", "CPUAdagrad", "DeepSpeedCPUAdagrad", "CPULion", "DeepSpeedCPULion")


def check_client_optimizer(base: torch.optim.Optimizer, force_ds_cpu_optimizer: bool) -> None:
    """DeepSpeed's rule: a client optimizer with optimizer offload must be a CPU optimizer, unless
    ``zero_force_ds_cpu_optimizer`` is false (the client optimizer then steps host tensors)."""
    name = type(base).__name__
    if force_ds_cpu_optimizer and name not in CPU_OPTIMIZERS:
        raise ClientOptimizerError(
            f"zero_optimization.offload_optimizer is on with a client optimizer ({name}), which would step "
            "the offloaded fp32 state slowly in host memory. Use zero_ext.ops.adam.CPUAdam (DeepSpeedCPUAdam), "
            "or give an 'optimizer' section in the config (the engine then builds the C optimizer); to use "
            'your optimizer anyway, set "zero_force_ds_cpu_optimizer": false.')


def is_fused_like(opt_cfg, client, base: torch.optim.Optimizer) -> bool:
    """Whether DeepSpeed would hold ``base`` as its FusedAdam: a FusedAdam passed in, or the one it builds
    for a config Adam/AdamW section without torch_adam (what picks FP16_Optimizer over the unfused one)."""
    if client is not None:
        return type(base).__name__ == "FusedAdam"
    return opt_cfg is not None and opt_cfg.is_adam and not opt_cfg.params_with_defaults().get("torch_adam")


def is_cpu_optimizer(base: torch.optim.Optimizer) -> bool:
    """Whether ``base`` takes grad_scale/fp16_param_groups in step() (the fused offloaded step)."""
    return isinstance(base, CPUOptimizer)


# Optimizers ZeRO is tested with (DeepSpeed's list, in zero_ext's terms): element-wise updates, which
# give the same result on a flat partition as on the parameters. Others need
# zero_allow_untested_optimizer (a shape-aware optimizer cannot run on flat partitions).
ZERO_SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "FusedAdam", "Adagrad", "CPUAdam", "CPUAdagrad", "CPULion",
                             "DeepSpeedCPUAdam", "TorchStepped", "MuonWithAuxAdam")


def check_zero_optimizer(base: torch.optim.Optimizer, stage: int, allow_untested: bool) -> None:
    """ZeRO steps flat partitions: only element-wise optimizers are right there, unless the config
    says ``zero_allow_untested_optimizer``."""
    if stage == 0 or allow_untested:
        return
    name = type(base).__name__
    if name not in ZERO_SUPPORTED_OPTIMIZERS:
        raise InitializeArgumentError(
            f"zero_ext.initialize: {name} is an untested ZeRO optimizer: ZeRO steps it on flat partitions of "
            "the parameters, which is only right for element-wise optimizers (Adam, AdamW, Adagrad, Lion). "
            'Add "zero_allow_untested_optimizer": true to the config to use it anyway.')


def check_client_params(model: torch.nn.Module, base: torch.optim.Optimizer) -> None:
    """A client optimizer must hold the model's parameters, and no state yet (ZeRO repartitions it)."""
    names = {id(p) for p in model.parameters()}
    for group in base.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("zero_ext.initialize: the optimizer holds a tensor that is not a parameter of "
                                 "the model; build it over model.parameters()")
    if base.state:
        raise ValueError("zero_ext.initialize: the optimizer already has state (it has stepped); pass a fresh "
                         "optimizer — ZeRO repartitions its state")


def adopt_masters(base: torch.optim.Optimizer) -> None:
    """After the base optimizer's groups were given the fp32 masters in place of the model's parameters:
    state its constructor made for those parameters is dropped, and the masters get the same. Only
    torch's Adagrad before torch 2.5 fills state in its constructor (the later ones, and every other
    optimizer here, fill it at the first step); left as it was, its step would look for the masters'
    "sum" and fail, and the parameters' full-size sums would stay allocated."""
    live = {id(p) for group in base.param_groups for p in group["params"]}
    stale = [p for p in base.state if id(p) not in live]
    if not stale or not isinstance(base, torch.optim.Adagrad):
        for p in stale:
            del base.state[p]
        return
    step = base.state[stale[0]].get("step")
    for p in stale:
        del base.state[p]
    for group in base.param_groups:
        for p in group["params"]:
            state = base.state[p]
            if not state:  # torch's constructor's values, for the master
                state["step"] = torch.zeros_like(step) if torch.is_tensor(step) else 0
                state["sum"] = torch.full_like(p, group["initial_accumulator_value"])
