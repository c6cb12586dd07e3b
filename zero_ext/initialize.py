"""``zero_ext.initialize``: DeepSpeed's entry point, checks first, then the engine."""
import logging
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import comm
from .config import ConfigError, load_config, reject_unimplemented
from .engine import ZeroEngine
from .offload.plan import OffloadPlan
from .optim.factory import build_offload_optimizer, check_client_optimizer, is_cpu_optimizer
from .optim.factory import build_optimizer
from .optim.schedulers import configure_lr_scheduler

logger = logging.getLogger("zero_ext")

# Keys the UNIMPLEMENTED table lists that this engine does implement (the table is shared with
# zero.Init, which implements less).
IMPLEMENTED = ("zero_optimization.ignore_unused_parameters", "fp16.enabled", "communication_data_type",
               "prescale_gradients", "gradient_predivide_factor", "data_types.grad_accum_dtype",
               "checkpoint.tag_validation", "checkpoint.load_universal")

# Optimizers ZeRO is tested with (DeepSpeed's list, in zero_ext's terms): element-wise updates, which
# give the same result on a flat partition as on the parameters. Others need
# zero_allow_untested_optimizer (a shape-aware optimizer cannot run on flat partitions).
ZERO_SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "CPUAdam", "CPUAdagrad", "CPULion", "DeepSpeedCPUAdam")


def initialize(args=None, model: Optional[torch.nn.Module] = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: Optional[bool] = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None) -> Tuple[ZeroEngine, Any, Any, Any]:
    """Builds the engine: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` (or ``config_params``, or ``args.deepspeed_config``) is a dict or a JSON path.
    ``optimizer`` is a torch optimizer over the model's parameters, or a callable taking the
    parameters; otherwise the config's ``optimizer`` section builds one. ``lr_scheduler`` is a
    scheduler or a callable taking the optimizer. ``training_data`` (a Dataset) gives a loader with a
    distributed sampler and the micro batch size.
    """
    if model is None:
        raise ValueError("zero_ext.initialize: model is required (pass model=your_module)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zero_ext.initialize: model must be a torch.nn.Module, not {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise ValueError("zero_ext.initialize: model parallelism (mpu, mesh_param) is not supported by zero_ext; "
                         "zero_ext is data-parallel ZeRO only")
    source = _config_source(args, config, config_params)
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required, verbose=False)
    world, rank = comm.get_world_size(), comm.get_rank()
    cfg = load_config(source)
    cfg.resolve_batch(world)
    reject_unimplemented(cfg, implemented=IMPLEMENTED)
    _check_grad_accum_dtype(cfg)

    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable and (optimizer is not None or cfg.optimizer is not None):
        raise ValueError("zero_ext.initialize: the model has no trainable parameters (every parameter has "
                         "requires_grad=False); there is nothing to optimize")
    if optimizer is not None and cfg.optimizer is not None:
        raise ValueError("zero_ext.initialize: an optimizer was passed and the config has an 'optimizer' "
                         "section; give only one (remove the section, or the optimizer argument)")
    inference = optimizer is None and cfg.optimizer is None  # a forward-only engine (e.g. a reference model)

    device = _device()
    dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else None
    zero_model = None
    if cfg.zero_optimization.stage == 3:
        zero_model = _install_stage3(model, cfg, device, dtype, world)
    else:
        model.to(device)
        if dtype is not None:
            model.to(dtype)
        if world > 1:
            _broadcast_from_rank0(model)

    groups = _param_groups(model, model_parameters)
    offload = OffloadPlan(cfg.zero_optimization)
    if inference:
        base = None
    elif optimizer is None:
        # with optimizer offload the engine builds the C optimizer itself (DeepSpeed's rule)
        base = (build_offload_optimizer(cfg.optimizer, groups) if offload.optimizer else None) \
            or build_optimizer(cfg.optimizer, groups)
    elif isinstance(optimizer, torch.optim.Optimizer):
        base = optimizer
        _check_client_optimizer(model, base)
    elif callable(optimizer):
        base = optimizer(groups)
        if not isinstance(base, torch.optim.Optimizer):
            raise TypeError(f"zero_ext.initialize: the optimizer callable returned {type(base).__name__}, not "
                            "a torch.optim.Optimizer")
    else:
        raise TypeError(f"zero_ext.initialize: optimizer must be a torch.optim.Optimizer or a callable, not "
                        f"{type(optimizer).__name__}")
    if base is not None:
        _check_zero_optimizer(base, cfg)
        if offload.optimizer and optimizer is not None:
            check_client_optimizer(base, cfg.zero_force_ds_cpu_optimizer)
        if offload.optimizer and offload.ratio < 1.0 and is_cpu_optimizer(base):
            base.device_params = True  # the sub-groups kept on the accelerator step with torch operations
    loader = _dataloader(training_data, cfg, collate_fn, rank, world)
    engine = ZeroEngine(model, cfg, base, training_dataloader=loader, device=device, zero_model=zero_model)
    # a client scheduler (object, or callable taking the optimizer) wins over the config's section
    if base is not None:
        engine.lr_scheduler = configure_lr_scheduler(lr_scheduler, cfg.scheduler, engine.optimizer,
                                                     basic_optimizer=base)
    logger.info("zero_ext: stage %d, %s, world size %d, batch %d = %d x %d x %d", cfg.zero_optimization.stage,
                cfg.precision, world, cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                cfg.gradient_accumulation_steps, world)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _install_stage3(model: torch.nn.Module, cfg, device: torch.device, dtype, world: int):
    """Stage 3: the model's whole parameters are cast and partitioned (rank 0's values), those built
    under zero.Init must already have the training dtype; then the fetch/release hooks go on."""
    from .zero import ZeroModel
    from .zero.leaf import apply_leaf_config
    from .zero.param import zero_param_of

    want = dtype or torch.float32
    with torch.no_grad():
        for p in model.parameters():
            zp = zero_param_of(p)
            if zp is not None:
                if zp.dtype != want:
                    raise ValueError(f"zero_ext.initialize: parameter {getattr(zp, 'name', '')} was built under "
                                     f"zero.Init as {zp.dtype}, but the config trains in {want}; build the model "
                                     "under zero.Init(config_dict_or_path=<the same config>) so they agree")
            else:
                p.data = p.data.to(device=device, dtype=want if p.is_floating_point() else p.dtype)
        for m in model.modules():
            for name, b in list(m.named_buffers(recurse=False)):
                cast = want if b.is_floating_point() and dtype is not None else b.dtype
                setattr(m, name, b.to(device=device, dtype=cast))
                if world > 1:
                    dist.broadcast(getattr(m, name), src=0)
    zc = cfg.zero_optimization
    leaf = zc.leaf_module
    apply_leaf_config(model, leaf.classes, leaf.names, leaf.name_suffixes)
    # the fixed-size agreement before every gather (a rank-dependent branch raises instead of hanging)
    # costs one small all-gather per fetch, per prefetch batch once the fetch order is recorded:
    # ZERO_EXT_CHECK_FETCH_ORDER=0 turns it off
    check = os.environ.get("ZERO_EXT_CHECK_FETCH_ORDER", "1") != "0"
    # offload_param: pieces in host memory (pieces made by zero.Init stay where Init put them)
    plan = OffloadPlan(zc)
    return ZeroModel(model, param_persistence_threshold=zc.param_persistence_threshold,
                     model_persistence_threshold=zc.model_persistence_threshold, check_fetch_order=check,
                     remote_device=plan.param_remote_device, pin_memory=plan.host.pin,
                     prefetch_bucket_size=zc.prefetch_bucket_size, max_live_parameters=zc.max_live_parameters,
                     max_reuse_distance=zc.max_reuse_distance, log_trace_cache_warnings=zc.log_trace_cache_warnings)


def _check_grad_accum_dtype(cfg) -> None:
    """Stage 2 accumulates gradients in fp32 partitions; stages 0/1 in the model's dtype (as DeepSpeed's
    stage 1 does). data_types.grad_accum_dtype may name what happens, nothing else yet."""
    want = cfg.data_types.grad_accum_dtype
    if want is None:
        return
    stage = cfg.zero_optimization.stage
    actual = "fp32" if stage == 2 else cfg.precision
    if want != actual:
        raise ConfigError(
            f"data_types.grad_accum_dtype = {want!r}: ZeRO stage {stage} with {cfg.precision} parameters "
            f"accumulates gradients in {actual}, and zero_ext implements no other choice yet; remove the key"
            + (" or use ZeRO stage 2, which accumulates in fp32" if want == "fp32" else ""))


def _check_zero_optimizer(base: torch.optim.Optimizer, cfg) -> None:
    if cfg.zero_optimization.stage == 0 or cfg.zero_allow_untested_optimizer:
        return
    name = type(base).__name__
    if name not in ZERO_SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"zero_ext.initialize: {name} is an untested ZeRO optimizer: ZeRO steps it on flat partitions of "
            "the parameters, which is only right for element-wise optimizers (Adam, AdamW, Adagrad, Lion). "
            'Add "zero_allow_untested_optimizer": true to the config to use it anyway.')


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


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", comm.get_local_rank())
    return torch.device("cpu")


def _broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Replicas start equal even when scripts seed each rank differently (as DeepSpeed does)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


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


def _check_client_optimizer(model: torch.nn.Module, base: torch.optim.Optimizer) -> None:
    names = {id(p) for p in model.parameters()}
    for group in base.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("zero_ext.initialize: the optimizer holds a tensor that is not a parameter of "
                                 "the model; build it over model.parameters()")
    if base.state:
        raise ValueError("zero_ext.initialize: the optimizer already has state (it has stepped); pass a fresh "
                         "optimizer — ZeRO repartitions its state")


def _dataloader(training_data, cfg, collate_fn, rank: int, world: int):
    if training_data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(training_data, num_replicas=world, rank=rank, shuffle=True)
    return DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler,
                      collate_fn=collate_fn, drop_last=getattr(cfg, "dataloader_drop_last", False))
