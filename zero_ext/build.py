"""The one builder: a checked config and model -> a ZeroEngine with everything it runs on.

``initialize`` checks its arguments and the config, then calls :func:`build_engine`, which in order:

1. places the model: stage 3 partitions it (over MiCS's shard groups with ``mics_shard_size``,
   zero/mics.py) and installs the fetch/release hooks (``zero.ZeroModel``),
   stages 0-2 move it to the device and dtype and broadcast rank 0's values;
2. makes the base optimizer (the client's, or the config's: the C one for host tensors — optimizer
   offload or a CPU run — else torch's; see optim/factory.py) and checks it;
3. with ``offload_param.device = "nvme"`` opens the store of the 16-bit pieces;
4. builds the ZeRO optimizer: flat groups (stages 0-2) or shard sub-groups (stage 3), the gradient
   reducer, the loss scaler; with ``offload_optimizer.device = "nvme"`` its state store;
5. hands all of it to ZeroEngine, which only runs it.

The OffloadPlan is read from the config once, here, and given to everything that needs it.

A build that fails is undone (hooks removed, swap files deleted, parameters the build partitioned made
whole again), so the model is as it was and ``initialize`` can be called again. A model whose
parameters a live engine still steps is handed over: that engine is destroyed first, with a warning.
"""
import copy
import hashlib
import logging
import os
import warnings
from typing import Any, Dict, List, Optional

import torch

from . import comm
from .accelerator import compute_device, get_accelerator
from .comm.collective_check import call_number, check_all_ranks_call
from .comm.mpu import ParallelGroups, parallel_groups
from .config import ConfigError
from .engine import StepPhase, ZeroEngine, engine_of, engine_of_module
from .nvme.pieces import NVMePieces
from .nvme.store import NVMeStateStore
from .nvme.swap_dir import check_nvme_path
from .offload.plan import OffloadPlan
from .optim.factory import (build_optimizer, check_client_optimizer, check_client_params, check_zero_optimizer,
                            is_cpu_optimizer, is_fused_like)
from .optim.flat_group import FlatGroup
from .optim.grad_reduce import Averaging, BoundaryReducer, BucketReducer
from .optim.loss_scaler import gradscaler_like, scaler_from_config
from .optim.muon import MuonWithAuxAdam, muon_param_groups
from .optim.quantized_reduce import Hierarchy
from .optim.schedulers import configure_lr_scheduler
from .optim import bf16_master
from .optim.bf16_master import master_dtype
from .optim.experts import Domain, DomainReducers, configure_moe, domain_of_group, moe_layers, split_base_groups
from .optim.shard_groups import ShardReducer, build_shard_groups
from .optim.zero_optimizer import ZeroOptimizer
from .precision.autocast import mark_safe_params, record_initialized, resolve_dtype
from .zero import ZeroModel, unpartition
from .zero.ds_surface import ParameterOffload
from .zero.leaf import apply_leaf_config, set_leaf_modules_by_granularity
from .zero.param import zero_param_of
from .moe.params import is_moe_param
from .zero.mics import MiCSGroups, mics_groups, of as mics_of
from .zero.secondary import node_groups

logger = logging.getLogger("zero_ext")

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def build_engine(model: torch.nn.Module, cfg, optimizer, groups: List[Dict[str, Any]], lr_scheduler=None,
                 training_dataloader=None, mpu=None, parallel: Optional[ParallelGroups] = None) -> ZeroEngine:
    """The engine for ``model`` under the checked config ``cfg``. ``optimizer`` is the client's (a
    torch optimizer or a callable taking ``groups``), or None: then the config's section, if any, builds
    one (without either the engine runs forward only). ``parallel``: the data- and model-parallel groups
    of ``mpu`` (comm/mpu.py); ZeRO works over the data-parallel one."""
    parallel = parallel or parallel_groups(mpu)
    world, rank, pg = parallel.dp_world, parallel.dp_rank, parallel.dp_group
    _agree_across_ranks(model, cfg)
    _hand_over(model)
    device = compute_device()
    plan = OffloadPlan(cfg.zero_optimization)
    bf16_master.check_config(cfg, plan)
    was_partitioned = {id(p) for p in model.parameters() if zero_param_of(p) is not None}
    made = _Made()
    try:
        mics = _mics_groups(cfg.zero_optimization, plan, world, parallel)
        # MoE layers: their process groups, and the expert parameters' domains (optim/experts.py)
        domains = configure_moe(model, cfg.zero_optimization.stage, world, mpu,
                                cfg.use_data_before_expert_parallelism)
        made.zero_model = _place_model(model, cfg, device, world, plan, pg, mics, domains)
        autocast_dtype = _init_autocast(model, cfg, device)
        base = _base_optimizer(model, cfg, optimizer, groups, plan)
        if plan.param_device == "nvme":
            made.nvme_pieces = _open_nvme_pieces(model, cfg, plan, base is not None)
        if base is not None:
            made.zopt = _zero_optimizer(base, cfg, plan, made.zero_model, made.nvme_pieces, device, rank, world,
                                        parallel, mics, autocast_dtype, domains)
            made.zopt.fused_base = is_fused_like(cfg.optimizer, optimizer, base)
            if made.zero_model is not None:  # DeepSpeed's hook surface at stage 3 (TRL removes and re-adds hooks)
                made.zopt.parameter_offload = ParameterOffload(made.zero_model)
            if plan.optimizer_device == "nvme":
                _attach_nvme(made.zopt, cfg)
        if made.nvme_pieces is not None:
            _add_other_pieces(model, made.nvme_pieces)
        scheduler = None
        if base is not None:  # a client scheduler (object, or callable taking the optimizer) wins over the config's
            scheduler = configure_lr_scheduler(lr_scheduler, cfg.scheduler, made.zopt, basic_optimizer=base)
    except BaseException:
        made.undo(model, was_partitioned)
        raise
    if made.zopt is not None:
        _name_bucket_members(model, made.zopt)
    engine = ZeroEngine(model, cfg, made.zopt, plan, device=device, zero_model=made.zero_model,
                        nvme_pieces=made.nvme_pieces, lr_scheduler=scheduler, training_dataloader=training_dataloader)
    engine.mpu, engine.world_size, engine.dp_world_size = mpu, world, world  # (DeepSpeed's: the data-parallel size)
    engine.moe_layers = moe_layers(model)
    engine.has_moe_layers = bool(engine.moe_layers)
    engine.num_experts = [m.num_experts for m in engine.moe_layers]
    if cfg.log_level is not None:  # (checked by the config: one of logging's level names, any case)
        logging.getLogger("zero_ext").setLevel(cfg.log_level.upper())
    if cfg.wall_clock_breakdown and made.zopt is not None:  # the reducer's own work, as "bwd_allreduce"
        for name in ("reduce", "finish_backward"):
            if hasattr(made.zopt.reducer, name):
                setattr(made.zopt.reducer, name, engine.wall_clock.timed("bwd_allreduce",
                                                                         getattr(made.zopt.reducer, name)))
    logger.info("zero_ext: stage %d, %s, world size %d, batch %d = %d x %d x %d; CPU collectives on %s",
                cfg.zero_optimization.stage, cfg.precision, world, cfg.train_batch_size,
                cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, world, comm.transport())
    return engine


def _name_bucket_members(model: torch.nn.Module, zopt: ZeroOptimizer) -> None:
    """Stage 2: the reducer's parameter names, for the error of ranks that reduce different buckets."""
    names = {id(p): n for n, p in model.named_parameters()}
    for reducer in getattr(zopt.reducer, "reducers", [zopt.reducer]):  # (one per domain with MoE)
        if isinstance(reducer, BucketReducer):
            reducer.names = {k: names.get(id(reducer.groups[gi].params[i]), f"#{k}")
                             for (gi, i), k in reducer.index.items()}


def _agree_across_ranks(model: torch.nn.Module, cfg) -> None:
    """One small agreement before anything collective: a rank with another config or model would
    otherwise hang, or abort inside gloo, at the first collective that does not match."""
    zc = cfg.zero_optimization
    params = [(n, tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype), p.requires_grad)
              for n, p in model.named_parameters()]
    shapes = hashlib.sha256(repr(params).encode()).hexdigest()[:12]
    devices = [getattr(getattr(section, "device", None), "value", getattr(section, "device", "none"))
               for section in (zc.offload_optimizer, zc.offload_param)]
    detail = (f"stage={zc.stage} precision={cfg.precision} micro_batch={cfg.train_micro_batch_size_per_gpu} "
              f"accumulation={cfg.gradient_accumulation_steps} reduce_bucket_size={zc.reduce_bucket_size} "
              f"allgather_bucket_size={zc.allgather_bucket_size} sub_group_size={zc.sub_group_size} "
              f"offload_optimizer={devices[0]} offload_param={devices[1]} mics_shard_size={zc.mics_shard_size} "
              f"parameters={len(params)} shapes={shapes}")
    check_all_ranks_call("zero_ext.initialize", call_number("initialize"), detail=detail,
                         hint="; every rank must build the same model with the same config")


class _Made:
    """What a build has made so far, to undo it when a later part fails."""

    zero_model = None
    nvme_pieces = None
    zopt = None

    def undo(self, model: torch.nn.Module, was_partitioned) -> None:
        if self.zopt is not None:
            self.zopt.reducer.remove_hooks()
            self.zopt.destroy_offload()
            self.zopt.release()
        if self.nvme_pieces is not None:
            self.nvme_pieces.bring_home()  # (the swap files go; the pieces stay in memory)
        if self.zero_model is not None:
            self.zero_model.destroy()
            # the parameters this build partitioned become whole again; zero.Init's stay as Init made them
            unpartition([p for p in model.parameters() if id(p) not in was_partitioned])


def _hand_over(model: torch.nn.Module) -> None:
    """A model whose parameters (or which itself) a live engine holds: that engine is destroyed, as
    DeepSpeed re-wraps such a model (its hooks would otherwise act on the new engine's gradients)."""
    olds = {id(e): e for e in [engine_of_module(model)] + [engine_of(p) for p in model.parameters()]
            if e is not None and e.phase is not StepPhase.DESTROYED}
    for old in olds.values():
        warnings.warn("zero_ext.initialize: this model is still held by another engine, which is now destroyed "
                      "(its hooks and optimizer state are removed); call engine.destroy() yourself before "
                      "building a new engine over the same model to silence this", RuntimeWarning, stacklevel=3)
        old.destroy()




# -- 1. the model -------------------------------------------------------------------------------------------

def _place_model(model: torch.nn.Module, cfg, device: torch.device, world: int, plan: OffloadPlan, pg=None,
                 mics: Optional[MiCSGroups] = None, domains: Optional[Dict[str, Domain]] = None):
    """Stage 3: the ZeroModel over the partitioned model; stages 0-2: None, the model on the device in
    the training dtype, rank 0's values on every rank (replicas start equal even when scripts seed
    each rank differently, as DeepSpeed does); an expert parameter's values are its expert-data-parallel
    group's first rank's (the ranks of an expert-parallel group hold different experts)."""
    dtype = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else None
    if cfg.zero_optimization.stage == 3:
        return _install_stage3(model, cfg, device, dtype, world, plan, pg, mics)
    if any(zero_param_of(p) is not None for p in model.parameters()):
        # Built under zero.Init (partitioned) but trained at a stage that keeps whole parameters on every
        # rank: gather them whole (DeepSpeed's engine would carry on with empty parameters).
        warnings.warn(f"zero_ext.initialize: the model's parameters were partitioned by zero.Init, but the config "
                      f"trains at ZeRO stage {cfg.zero_optimization.stage}, which keeps whole parameters on every "
                      "rank: they are gathered whole now (use stage 3 to keep them partitioned)", UserWarning,
                      stacklevel=4)
        unpartition(model)
    model.to(device)
    _cast_floating(model.parameters(), dtype)
    _cast_floating(model.buffers(), buffer_dtype(cfg))
    if world > 1:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dom = (domains or {}).get(getattr(t, "group_name", None)) if is_moe_param(t) else None
                group = pg if dom is None else dom.pg
                if dom is None or dom.world > 1:
                    comm.broadcast(t.data, src=_first_rank(group), group=group)
    return None


def buffer_dtype(cfg) -> Optional[torch.dtype]:
    """What floating-point buffers are cast to: ``data_types.buffer_dtype``, else nothing. As in DeepSpeed
    0.19.5+, fp16/bf16 cast the parameters only; a buffer keeps the dtype it was built in (an fp32 rotary
    ``inv_freq`` stays fp32), unless zero.Init built it in its dtype."""
    name = cfg.data_types.buffer_dtype
    return None if name is None else _DTYPES[name]


def _cast_floating(tensors, dtype: Optional[torch.dtype]) -> None:
    """Cast each floating-point tensor (parameter or buffer) to ``dtype`` in place (``.data``: modules keep
    their Parameter objects, as ``module.to(dtype)`` does)."""
    if dtype is None:
        return
    with torch.no_grad():
        for t in tensors:
            if t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)


def _first_rank(pg) -> int:
    """The global rank of the data-parallel group's rank 0 (its values are every replica's start)."""
    return 0 if pg is None else comm.get_global_rank(pg, 0)


def _install_stage3(model: torch.nn.Module, cfg, device: torch.device, dtype, world: int,
                    plan: OffloadPlan, pg=None, mics: Optional[MiCSGroups] = None) -> ZeroModel:
    """Stage 3: the model's whole parameters are cast and partitioned (rank 0's values), those built
    under zero.Init must already have the training dtype; then the fetch/release hooks go on."""
    want = dtype or torch.float32
    # torch_autocast without a bf16/fp16 section names no training dtype: as DeepSpeed, the parameters keep
    # theirs (e.g. a bf16 model built under zero.Init for autocast), as at stages 0-2
    keep = dtype is None and cfg.torch_autocast.enabled
    if not keep:
        _recast_dtype_free(model, want)
        _check_init_dtypes(model, want)
    with torch.no_grad():
        for p in model.parameters():
            zp = zero_param_of(p)
            if zp is not None:
                _check_partition_group(zp, mics)
            elif p.is_floating_point() and p.dtype != want and not keep:  # cast where it is: the partitioning moves
                p.data = p.data.to(dtype=want)                 # each piece, never the whole model
        buffers = buffer_dtype(cfg)
        for m in model.modules():
            for name, b in list(m.named_buffers(recurse=False)):
                cast = buffers if b.is_floating_point() and buffers is not None else b.dtype
                setattr(m, name, b.to(device=device, dtype=cast))
                if world > 1:
                    comm.broadcast(getattr(m, name), src=_first_rank(pg), group=pg)
    zc = cfg.zero_optimization
    leaf = zc.leaf_module
    apply_leaf_config(model, leaf.classes, leaf.names, leaf.name_suffixes)
    set_leaf_modules_by_granularity(model, zc.module_granularity_threshold)
    # the fixed-size agreement before every gather (a rank-dependent branch raises instead of hanging)
    # costs one small all-gather per fetch, per prefetch batch once the fetch order is recorded:
    # ZERO_EXT_CHECK_FETCH_ORDER=0 turns it off
    check = os.environ.get("ZERO_EXT_CHECK_FETCH_ORDER", "1") != "0"
    hpz = _hpz_groups(zc, plan, world)
    # offload_param: pieces in host memory (pieces made by zero.Init stay where Init put them)
    zero_model = ZeroModel(
        model, group=mics.shard_group if mics is not None else pg,
        param_persistence_threshold=zc.param_persistence_threshold,
        model_persistence_threshold=zc.model_persistence_threshold, check_fetch_order=check,
        remote_device=plan.param_remote_device, pin_memory=plan.host.pin,
        prefetch_bucket_size=zc.prefetch_bucket_size, max_live_parameters=zc.max_live_parameters,
        max_reuse_distance=zc.max_reuse_distance, log_trace_cache_warnings=zc.log_trace_cache_warnings,
        quantized_weights=zc.zero_quantized_weights, hpz=hpz, quantized_frozen=zc.zero_quantized_nontrainable_weights)
    for zp in _zero_params_of(model):
        zp.sanity_checks = zc.enable_sanity_checks  # read-only GatheredParameters blocks checked (gathered.py)
        zp.gather_by_all_reduce = zc.use_all_reduce_for_fetch_params  # (zero/collectives.py)
    return zero_model


def _zero_params_of(model: torch.nn.Module) -> List:
    """The ZeroParams of the model's partitioned parameters, each once."""
    return list({id(z): z for z in map(zero_param_of, model.parameters()) if z is not None}.values())


def _recast_dtype_free(model: torch.nn.Module, want: torch.dtype) -> None:
    """Parameters built under a zero.Init that named no dtype (neither argument nor config) take the
    training dtype, as DeepSpeed's Init would have given them its own (fp16) and its engine the config's."""
    for zp in _zero_params_of(model):
        if zp.recastable and zp.dtype.is_floating_point and zp.dtype != want:
            zp.recast(want)


def _check_init_dtypes(model: torch.nn.Module, want: torch.dtype) -> None:
    """Parameters partitioned by zero.Init keep their dtype, as in DeepSpeed: a model may mix them (an
    fp32 LoRA adapter added with ``param.convert_to_zero_parameters`` next to a bf16 base). But when no
    floating-point one has the training dtype, the model was built under a zero.Init that did not see the
    config (a mistake, not a mix): refused."""
    dtypes = {zp.dtype for zp in map(zero_param_of, model.parameters()) if zp is not None and zp.dtype.is_floating_point}
    if dtypes and want not in dtypes:
        found = ", ".join(sorted(str(d) for d in dtypes))
        raise ValueError(f"zero_ext.initialize: the model's parameters were built under zero.Init as {found}, "
                         f"but the config trains in {want}; build the model under "
                         "zero.Init(config_dict_or_path=<the same config>) so they agree")


def _hpz_groups(zc, plan: OffloadPlan, world: int):
    """ZeRO++ hpZ's node groups: (this rank's group, its rank there, size), or None when off."""
    size = zc.zero_hpz_partition_size
    if size <= 1:
        return None
    if world % size:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size = {size} does not divide the {world} ranks: "
                          "hpZ's secondary partition spans whole nodes; use a divisor of the world size")
    if plan.param_remote_device is not None:
        raise ConfigError("zero_optimization.zero_hpz_partition_size > 1 with offload_param: hpZ keeps a "
                          "secondary copy of the parameters on the device, which offloading them removes; "
                          "use one or the other")
    found = node_groups(size, world, comm.get_rank(), comm.new_group)
    return None if found is None else (*found, size)


def _mics_groups(zc, plan: OffloadPlan, world: int, parallel: ParallelGroups) -> Optional[MiCSGroups]:
    """MiCS's shard and replica groups (zero/mics.py), or None when off. The rules that need the world
    size are checked here (the config's own rules ran at load)."""
    if zc.stage != 3 or zc.mics_shard_size <= 0:
        return None
    size = zc.mics_shard_size
    if parallel.dp_group is not None:
        raise ConfigError(f"zero_optimization.mics_shard_size = {size} with an mpu: MiCS cuts its shard groups "
                          "from the whole world, not from the mpu's data-parallel group; remove mics_shard_size "
                          "or the mpu")
    if plan.optimizer and world > size and world % size == 0:
        # DeepSpeed's MiCS refused this at its first reduction ("Local sharding has no support for CPU
        # offloading"): the replica all-reduce runs on the device partitions
        raise ConfigError(f"zero_optimization.mics_shard_size = {size} with offload_optimizer: MiCS all-reduces "
                          f"each gradient partition over its {world // size} replicas on the device, which "
                          "optimizer offload moves to host memory; remove offload_optimizer, or set "
                          f"mics_shard_size to the world size ({world}: no replicas)")
    return mics_groups(size, zc.mics_hierarchical_params_gather)


def _check_partition_group(zp, mics: Optional[MiCSGroups]) -> None:
    """A parameter zero.Init / zero.MiCS_Init partitioned must be cut as this engine's config says."""
    want = mics.shard_group if mics is not None else None
    if zp.group is want or (mics is None and mics_of(zp.group) is None):
        return
    name = getattr(zp, "name", "")
    if mics is not None:
        raise ValueError(f"zero_ext.initialize: parameter {name} was partitioned over another group than MiCS's "
                         f"shard groups of {mics.shard_size} ranks (zero_optimization.mics_shard_size); build the "
                         "model under zero.MiCS_Init(config_dict_or_path=<the same config>)")
    raise ValueError(f"zero_ext.initialize: parameter {name} was partitioned by zero.MiCS_Init, but the config has no "
                     "zero_optimization.mics_shard_size; build it under zero.Init, or give the engine the MiCS config")


def _qgz_hierarchy(zc, world: int):
    """ZeRO++ qgZ's two levels where the world spans several nodes: nodes of zero_hpz_partition_size
    ranks when hpZ is on, else of the ranks per host (LOCAL_WORLD_SIZE on CPU, as DeepSpeed's
    device_count); None for one level."""
    size = zc.zero_hpz_partition_size if zc.zero_hpz_partition_size > 1 else get_accelerator().device_count()
    return Hierarchy.build(size, world, comm.get_rank(), comm.new_group)


# -- 2. the base optimizer ------------------------------------------------------------------------------------

def _base_optimizer(model, cfg, optimizer, groups, plan: OffloadPlan) -> Optional[torch.optim.Optimizer]:
    if optimizer is None and cfg.optimizer is None:
        return None  # a forward-only engine (e.g. a reference model)
    if optimizer is None and cfg.optimizer.type == "muon":  # Muon's matrices and Adam's rest (optim/muon.py)
        base = MuonWithAuxAdam(muon_param_groups(model, groups, cfg.optimizer.params),
                               momentum_in_memory=cfg.zero_optimization.save_muon_momentum_buffer_in_memory)
    elif optimizer is None:
        # host tensors (offloaded, or a CPU run) step on the C optimizer unless the config asks for torch's
        base = build_optimizer(cfg.optimizer, groups, offloaded=bool(plan.optimizer),
                               nvme=plan.optimizer_device == "nvme",
                               bf16_master=cfg.bf16.bf16_master_weights_and_grads)
    elif isinstance(optimizer, torch.optim.Optimizer):
        base = optimizer
        check_client_params(model, base)
    elif callable(optimizer):
        base = optimizer(groups)
        if not isinstance(base, torch.optim.Optimizer):
            raise TypeError(f"zero_ext.initialize: the optimizer callable returned {type(base).__name__}, not "
                            "a torch.optim.Optimizer")
    else:
        raise TypeError(f"zero_ext.initialize: optimizer must be a torch.optim.Optimizer or a callable, not "
                        f"{type(optimizer).__name__}")
    check_zero_optimizer(base, cfg.zero_optimization.stage, cfg.zero_allow_untested_optimizer)
    if plan.optimizer and optimizer is not None:
        check_client_optimizer(base, cfg.zero_force_ds_cpu_optimizer)
    bf16_master.check_base(cfg, base, plan, client=optimizer is not None)
    if plan.optimizer and plan.ratio < 1.0 and is_cpu_optimizer(base):
        base.device_params = True  # the sub-groups kept on the accelerator step with torch operations
    return base


# -- 3./4. the ZeRO optimizer and its NVMe stores -------------------------------------------------------------

def _init_autocast(model, cfg, device) -> Optional[torch.dtype]:
    """torch_autocast: the safe modules' parameters get their ``comm_dtype`` (precision/autocast.py); the
    autocast dtype, or None when it is off."""
    if not cfg.torch_autocast.enabled:
        return None
    dtype = resolve_dtype(cfg, device.type)
    mark_safe_params(model, dtype, cfg.torch_autocast.lower_precision_safe_modules)
    record_initialized(dtype)
    return dtype


def _averaging(cfg, world: int, model_dtype: torch.dtype, stage: int) -> Averaging:
    comm_dtype = _DTYPES.get(cfg.communication_data_type, model_dtype)
    # stages 1-3 send the autocast parameters' gradients in their comm_dtype; stage 0, as DeepSpeed's, does not
    return Averaging(world, comm_dtype, cfg.prescale_gradients, cfg.gradient_predivide_factor,
                     summed=cfg.gradient_allreduce_op == "sum", per_param=cfg.torch_autocast.enabled and stage > 0)


def _zero_optimizer(base, cfg, plan: OffloadPlan, zero_model, nvme_pieces, device, rank: int,
                    world: int, parallel: ParallelGroups, mics: Optional[MiCSGroups] = None,
                    autocast_dtype: Optional[torch.dtype] = None,
                    domains: Optional[Dict[str, Domain]] = None) -> ZeroOptimizer:
    zc = cfg.zero_optimization
    pg = parallel.dp_group  # the partition group: the data-parallel group, or MiCS's shard group
    after_step = []
    if zc.stage == 3:
        everyone = world  # gradients are averaged over every rank, MiCS's replicas too
        replicas = None
        if mics is not None:
            pg, rank, world = mics.shard_group, mics.shard_rank, mics.shard_size
            replicas = mics.replica_group if mics.replicas > 1 else None
        on_group = (lambda k, g: _register_piece_group(nvme_pieces, cfg, k, g)) if nvme_pieces is not None else None
        _, groups = build_shard_groups(base, zero_model, zc.sub_group_size, rank, world, plan=plan,
                                       on_group=on_group, process_group=pg, master_dtype=master_dtype(cfg))
        averaging = _averaging(cfg, everyone, groups[0].dtype, zc.stage)
        # qgZ in two levels across nodes; in one inside a MiCS shard group or an mpu's data-parallel group
        hierarchy = _qgz_hierarchy(zc, world) if zc.zero_quantized_gradients and pg is None else None
        reducer = ShardReducer(groups, zero_model, zc.reduce_bucket_size, zc.overlap_comm, averaging, rank, world,
                               zc.ignore_unused_parameters, process_group=pg, quantized=zc.zero_quantized_gradients,
                               replicas=replicas, hierarchy=hierarchy)
        after_step.append(zero_model.refresh_persistent)
        after_step.append(zero_model.drop_secondary)  # hpZ's copies were cut from the old pieces
    else:
        host = plan.host if plan.optimizer else None
        groups: List[Optional[FlatGroup]] = []
        split_base_groups(base, domains or {})
        for group in base.param_groups:
            trainable = [p for p in group["params"] if p.requires_grad]
            if not trainable:
                groups.append(None)
                group["params"] = []
                continue
            dom = domain_of_group(trainable, domains or {})
            g = FlatGroup(trainable, world if dom is None else dom.world, rank if dom is None else dom.rank,
                          partitioned=zc.stage >= 1, keep_lp_grads=zc.stage < 2, device=device, host=host,
                          accum_fp32=cfg.data_types.grad_accum_dtype == "fp32", master_dtype=master_dtype(cfg),
                          process_group=pg if dom is None else dom.pg, domain=dom)
            group["params"] = [g.master]
            groups.append(g)
        flat = [g for g in groups if g is not None]
        averaging = _averaging(cfg, world, flat[0].boundary_grad.dtype if zc.stage < 2 else flat[0].dtype, zc.stage)
        reducer = _flat_reducers(flat, zc, averaging, world, rank, pg, summed=cfg.gradient_allreduce_op == "sum")
    opt = ZeroOptimizer(base, groups, reducer, zc.stage, cfg.gradient_clipping, zc.allgather_bucket_size, rank,
                        world, loss_scaler=gradscaler_like() if autocast_dtype == torch.float16 else
                        scaler_from_config(cfg.fp16, zc.stage), process_group=pg, after_step=after_step,
                        nvme_pieces=nvme_pieces, model_parallel=parallel)
    opt.check_overflow = not (cfg.bf16.enabled and not cfg.bf16.check_grad_overflow)
    return opt


def _flat_reducers(flat: List[FlatGroup], zc, averaging: Averaging, world: int, rank: int, pg, summed: bool):
    """Stages 0-2: the reducer of the flat groups; with expert-parallel groups (optim/experts.py) one per
    domain, each over its own process group, all averaging over every rank."""
    def make(groups, w, r, group, avg):
        if zc.stage == 2:
            return BucketReducer(groups, zc.reduce_bucket_size, zc.overlap_comm, zc.contiguous_gradients,
                                 r, w, zc.ignore_unused_parameters, avg, process_group=group)
        return BoundaryReducer(groups, zc.reduce_bucket_size, avg, process_group=group)

    names = sorted({g.domain.name for g in flat if g.domain is not None})
    if not names:
        return make(flat, world, rank, pg, averaging)
    reducers, worlds = [], []
    dense = [g for g in flat if g.domain is None]
    if dense:
        reducers.append(make(dense, world, rank, pg, averaging))
        worlds.append(world)
    for name in names:  # the same order on every rank
        mine = [g for g in flat if g.domain is not None and g.domain.name == name]
        dom = mine[0].domain
        avg = copy.copy(averaging)
        if dom.world == 1 and not summed:  # one rank holds the expert: no reduction, only the average
            avg.alone = 1.0 / world
        reducers.append(make(mine, dom.world, dom.rank, dom.pg, avg))
        worlds.append(dom.world)
    return DomainReducers(reducers, worlds)


def _attach_nvme(opt: ZeroOptimizer, cfg) -> None:
    """offload_optimizer.device = "nvme": masters and optimizer state go to swap files under nvme_path,
    one file per sub-group of sub_group_size elements, streamed through buffer_count host buffers."""
    oc = cfg.zero_optimization.offload_optimizer
    # before any training: the directory works and has room for this rank's files (plus the padding
    # of each file to a page), twice: each sub-group's spare file, written by a step while the file
    # holding the state from before it stays whole ([Note: NVMe step transaction], optim/nvme_step.py)
    need = 2 * sum(opt.nvme_file_bytes(g) + 4096 for g in opt.flat_groups)
    check_nvme_path(oc.nvme_path, need)
    # No more buffers than groups: each buffer in use holds a different group, so a larger pool would
    # only keep copies (a stage-1/2 partition within sub_group_size is one group).
    sub_group_size = cfg.zero_optimization.sub_group_size
    groups = sum(len(opt.nvme_slices(g, sub_group_size)) for g in opt.flat_groups)
    count = max(1, min(oc.buffer_count, groups))
    store = NVMeStateStore(oc.nvme_path, count, aio=cfg.aio, pin_memory=oc.pin_memory, spare_slot=True)
    opt.attach_nvme(store, oc.pipeline_read, oc.pipeline_write, oc.fast_init, sub_group_size)


def _open_nvme_pieces(model, cfg, plan: OffloadPlan, has_optimizer: bool) -> NVMePieces:
    """offload_param.device = "nvme" (stage 3): the 16-bit pieces go to swap files under its nvme_path —
    one file per optimizer sub-group's piece buffer, written as the sub-group is made, and one per other
    piece (frozen parameters, every piece of a forward-only engine) — and are read through buffer_count
    host buffers when used. Pieces zero.Init(remote_device="nvme") already wrote stay in its files."""
    pc = cfg.zero_optimization.offload_param
    if has_optimizer and (not plan.optimizer or plan.ratio < 1.0):
        raise ConfigError('zero_optimization.offload_param.device = "nvme" needs the optimizer offloaded whole: '
                          'set offload_optimizer.device to "cpu" or "nvme" (and ratio 1)')
    zps = _zero_params_of(model)
    elem = next(iter(model.parameters())).element_size()
    # trained pieces twice: each sub-group's buffer has a spare file, so that a step is undone whole
    # when a write fails ([Note: NVMe step transaction], optim/nvme_step.py)
    copies = [1 + (has_optimizer and zp.param.requires_grad) for zp in zps]
    check_nvme_path(pc.nvme_path, sum(n * (zp.shard_numel * elem + 4096) for n, zp in zip(copies, zps)))
    store = NVMeStateStore(pc.nvme_path, pc.buffer_count, aio=cfg.aio, pin_memory=pc.pin_memory)
    return NVMePieces(store, pc.max_in_cpu)


def _register_piece_group(pieces: NVMePieces, cfg, k: int, g) -> None:
    """build_shard_groups' callback: sub-group k's piece buffer to its swap file, its host memory freed."""
    pc = cfg.zero_optimization.offload_param
    if g.flat.numel() > pc.buffer_size:
        raise ConfigError(f"zero_optimization.offload_param.buffer_size = {pc.buffer_size} elements is smaller "
                          f"than sub-group {k}'s pieces ({g.flat.numel()} elements): raise buffer_size, or "
                          "lower zero_optimization.sub_group_size")
    pieces.add_buffer(("lp", k), g.flat, list(zip(g.zparams, g.offsets, g.shards)), spare_slot=True)


def _add_other_pieces(model, pieces: NVMePieces) -> None:
    """The pieces no sub-group holds (frozen; all of a forward-only engine), unless zero.Init put them
    on NVMe already."""
    for zp in _zero_params_of(model):
        if zp.piece_io is None and not pieces.holds(zp):
            pieces.add_piece(("piece", zp.ds_id), zp)
