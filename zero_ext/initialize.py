"""``zero_ext.initialize``: DeepSpeed's entry point: checks the arguments and the config, then hands
them to the builder (build.py)."""
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, DistributedSampler

from . import activation_checkpointing, comm
from .build import build_engine
from .comm.mpu import parallel_groups
from .config import load_config, reject_unimplemented
from .config.errors import InitializeArgumentError, UnsupportedDtypeError
from .config.unimplemented import IMPLEMENTED_BY_INITIALIZE
from .engine import ZeroEngine

# Keys the UNIMPLEMENTED table lists that this engine does implement (the table is shared with
# zero.Init, which implements less); docs/config.md reads the same tuple.
IMPLEMENTED = IMPLEMENTED_BY_INITIALIZE


def initialize(args=None, model: Optional[torch.nn.Module] = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: Optional[bool] = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None) -> Tuple[ZeroEngine, Any, Any, Any]:
    """Builds the engine: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` (or ``config_params``, or ``args.deepspeed_config``) is a dict or a JSON path.
    ``optimizer`` is a torch optimizer over the model's parameters, or a callable taking the
    parameters (it wins over a config ``optimizer`` section, with a warning, as in DeepSpeed);
    otherwise the config's ``optimizer`` section builds one. ``lr_scheduler`` is a
    scheduler or a callable taking the optimizer. ``training_data`` (a Dataset) gives a loader with a
    distributed sampler and the micro batch size. ``mpu`` (Megatron-style model parallelism): ZeRO works
    over its data-parallel group, the gradient norm spans its model-parallel group too (comm/mpu.py).
    """
    if model is None:
        raise InitializeArgumentError("zero_ext.initialize: model is required (pass model=your_module)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zero_ext.initialize: model must be a torch.nn.Module, not {type(model).__name__}")
    if mesh_param is not None:
        raise ValueError("zero_ext.initialize: mesh_param (a device mesh) is not supported by zero_ext; give the "
                         "data- and model-parallel groups as an mpu instead")
    source = _config_source(args, config, config_params)
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required, verbose=False)
    parallel = parallel_groups(mpu)  # the data-parallel group ZeRO works over (comm/mpu.py)
    world, rank = parallel.dp_world, parallel.dp_rank
    cfg = load_config(source)
    cfg.resolve_batch(world)
    reject_unimplemented(cfg, implemented=IMPLEMENTED)
    _check_grad_accum_dtype(cfg)
    # the section a config writes is applied (DeepSpeed reads it only in checkpointing.configure)
    activation_checkpointing.configure_from_engine(cfg.activation_checkpointing,
                                                   given="activation_checkpointing" in cfg.raw)

    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable and (optimizer is not None or cfg.optimizer is not None):
        raise ValueError("zero_ext.initialize: the model has no trainable parameters (every parameter has "
                         "requires_grad=False); there is nothing to optimize")
    if optimizer is not None and cfg.optimizer is not None:  # DeepSpeed too steps the client's optimizer
        warnings.warn(f"zero_ext.initialize: an optimizer was passed and the config has an 'optimizer' section "
                      f"(type {cfg.optimizer.type!r}): the passed optimizer is used and the section is ignored; "
                      "remove one of them to silence this", UserWarning, stacklevel=2)
    groups = _param_groups(model, model_parameters)
    loader = _dataloader(training_data, cfg, collate_fn, rank, world)
    engine = build_engine(model, cfg, optimizer, groups, lr_scheduler=lr_scheduler, training_dataloader=loader,
                          mpu=mpu, parallel=parallel)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _check_grad_accum_dtype(cfg) -> None:
    """Stage 2 accumulates gradients in fp32 partitions; stages 0/1 in the model's dtype (as DeepSpeed's
    stage 1 does), except bf16 at stage 1 with grad_accum_dtype fp32, which accumulates in a full fp32
    buffer (DeepSpeed's BF16 optimizer). At stages 1-3 another grad_accum_dtype is ignored with a warning
    (DeepSpeed ignores it silently); at stage 0 it is refused, as DeepSpeed refuses mixes it lacks."""
    want = cfg.data_types.grad_accum_dtype
    if want is None:
        return
    stage = cfg.zero_optimization.stage
    if cfg.bf16.bf16_master_weights_and_grads:  # the gradient partitions are bf16 (optim/bf16_master.py)
        if want != "bf16":
            raise UnsupportedDtypeError(
                f"data_types.grad_accum_dtype = {want!r}: with bf16.bf16_master_weights_and_grads the gradients "
                "accumulate in bf16 partitions; remove the key (or set it to bf16), or remove "
                "bf16_master_weights_and_grads to accumulate in fp32")
        return
    bf16_fp32 = stage == 1 and cfg.precision == "bf16" and want == "fp32"
    actual = "fp32" if stage == 2 or bf16_fp32 else cfg.precision
    if want != actual and stage >= 1:  # DeepSpeed's ZeRO optimizers accept the key and ignore it: so do we, aloud
        warnings.warn(f"data_types.grad_accum_dtype = {want!r} is ignored: ZeRO stage {stage} with "
                      f"{cfg.precision} parameters accumulates gradients in {actual} (as DeepSpeed's stage {stage} "
                      "does); remove the key to silence this", UserWarning, stacklevel=3)
        return
    if want != actual:  # stage 0: DeepSpeed raises NotImplementedError for a mix it lacks
        raise UnsupportedDtypeError(
            f"data_types.grad_accum_dtype = {want!r}: ZeRO stage {stage} with {cfg.precision} parameters "
            f"accumulates gradients in {actual}, and zero_ext implements no other choice yet; remove the key"
            + (" or use ZeRO stage 2 (or stage 1 with bf16), which accumulate in fp32" if want == "fp32" else ""))


def _config_source(args, config, config_params):
    if config is not None and config_params is not None:
        raise ValueError("zero_ext.initialize: give config or config_params, not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and args is not None:
        from_args = getattr(args, "deepscale_config", None)
    if config is not None and from_args is not None:
        raise ValueError("zero_ext.initialize: the config is given twice (config= and args.deepspeed_config); "
                         "give it once")
    source = config if config is not None else from_args
    if source is None:
        raise ValueError("zero_ext.initialize: no config; pass config=dict_or_json_path or set "
                         "args.deepspeed_config")
    return source


def _param_groups(model: torch.nn.Module, model_parameters) -> List[Dict[str, Any]]:
    """model_parameters (tensors or group dicts) as group dicts, checked against the model."""
    if model_parameters is None:
        return [{"params": [p for p in model.parameters()]}]
    items = list(model_parameters)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    names = {id(p): n for n, p in model.named_parameters()}
    seen: Dict[int, str] = {}
    out = []
    for gi, group in enumerate(groups):
        params = group["params"]
        params = [params] if torch.is_tensor(params) else list(params)
        for p in params:
            if id(p) not in names:
                raise ValueError(f"zero_ext.initialize: model_parameters group {gi} holds a tensor of shape "
                                 f"{tuple(p.shape)} that is not a parameter of the model")
            if id(p) in seen:
                raise ValueError(f"zero_ext.initialize: parameter '{names[id(p)]}' appears twice in "
                                 f"model_parameters ({seen[id(p)]} and group {gi}); list each parameter once")
            seen[id(p)] = f"group {gi}"
        out.append({**group, "params": params})
    return out


def _dataloader(training_data, cfg, collate_fn, rank: int, world: int):
    if training_data is None:
        return None
    sampler = DistributedSampler(training_data, num_replicas=world, rank=rank, shuffle=True)
    return DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler,
                      collate_fn=collate_fn, drop_last=getattr(cfg, "dataloader_drop_last", False))
