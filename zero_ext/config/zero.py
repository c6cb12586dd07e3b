"""The ``zero_optimization`` section.

Keys, aliases and defaults are DeepSpeed's (``deepspeed/runtime/zero/config.py``, 0.19.x). Sizes
are element counts, not bytes. Where DeepSpeed's own docs (config-json.md) disagree with its code,
the code wins and ``ds_note`` says so (docs/config.md shows the notes).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Tuple

from pydantic import ValidationInfo, model_validator

from .base import MAX_ELEMENTS, ConfigModel, Int, built_directly, field_extra, option, rule_errors
from .errors import ConfigDeprecationWarning
from .messages import join_path
from .offload import OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig
from .zero_extras import LeafModuleConfig, ZenFlowConfig

#: Deprecated boolean keys and the section each one switches to CPU offload.
_DEPRECATED_OFFLOAD_SWITCHES = (("cpu_offload", "offload_optimizer"),
                                ("cpu_offload_param", "offload_param"))


class ZeroConfig(ConfigModel):
    """ZeRO: partition optimizer state (stage 1), gradients (2) and parameters (3)."""

    stage: Int = option(0, "ZeRO stage: 0 off, 1 optimizer state, 2 + gradients, "
                        "3 + parameters partitioned across data-parallel ranks.", ge=0, le=3)
    contiguous_gradients: bool = option(
        True, "Copy gradients into one contiguous buffer as they are produced (less "
        "fragmentation during backward).")
    reduce_scatter: bool = option(
        True, "Average gradients with reduce-scatter instead of all-reduce.")
    reduce_bucket_size: Int = option(
        500_000_000, "Elements reduced at a time; bounds the gradient bucket memory.", ge=0,
        le=MAX_ELEMENTS)
    use_multi_rank_bucket_allreduce: bool = option(
        True, "Stages 1-2: merge the reduce buckets of all ranks into one all-reduce.")
    allgather_partitions: bool = option(
        True, "Stages 1-2: gather updated parameters with all-gather instead of a series of "
        "broadcasts.")
    allgather_bucket_size: Int = option(
        500_000_000, "Stages 1-2: elements all-gathered at a time (a multiple of 2).", ge=0,
        le=MAX_ELEMENTS)
    overlap_comm: Optional[bool] = option(
        None, "Overlap gradient reduction with the backward pass. Unset: true for stage 3, "
        "false otherwise.", shown_default="true for stage 3, else false",
        ds_note="DeepSpeed's config docs say false; its code defaults to true for stage 3.")
    load_from_fp32_weights: bool = option(
        True, "On checkpoint load, initialise fp32 master weights from the saved fp32 copy "
        "(false: from the 16-bit weights, losing precision).")
    elastic_checkpoint: bool = option(
        False, "Deprecated, no effect: zero_ext checkpoints load into any world size and stage "
        "(true gives a deprecation warning).",
        ds_note="DeepSpeed merges stage-1/2 optimizer state across ranks with it; at stage 3 it "
        "warns that the key is deprecated.")
    offload_param: Optional[OffloadParamConfig] = option(
        None, "Parameter offload to CPU/NVMe (stage 3 only); see offload_param below.")
    offload_optimizer: Optional[OffloadOptimizerConfig] = option(
        None, "Optimizer-state offload to CPU/NVMe; see offload_optimizer below.")
    zenflow: Optional[ZenFlowConfig] = option(None, "ZenFlow settings; see zenflow below.")
    sub_group_size: Int = option(
        1_000_000_000, "Elements per optimizer sub-group (tile) stepped at a time; with "
        "offload_optimizer nvme also at stages 1/2 (slices of the partition swapped at a time).", ge=0,
        le=MAX_ELEMENTS,
        stage3_only=True, ds_note="DeepSpeed's docs example uses 1e12; its code default is 1e9.")
    cpu_offload_param: Optional[bool] = option(
        None, "Deprecated: true means offload_param = {\"device\": \"cpu\"}.",
        deprecated="offload_param")
    cpu_offload_use_pin_memory: Optional[bool] = option(
        None, "Deprecated: sets pin_memory of the offload sections.",
        deprecated="offload_param.pin_memory / offload_optimizer.pin_memory")
    cpu_offload: Optional[bool] = option(
        None, "Deprecated: true means offload_optimizer = {\"device\": \"cpu\"}.",
        deprecated="offload_optimizer")
    prefetch_bucket_size: Int = option(
        50_000_000, "Parameter elements fetched ahead of use.", ge=0, le=MAX_ELEMENTS,
        aliases=("stage3_prefetch_bucket_size",), stage3_only=True,
        ds_note="DeepSpeed's docs say 5e8; its code default is 5e7.")
    param_persistence_threshold: Int = option(
        100_000, "Parameters with at most this many elements stay whole on every rank "
        "(not partitioned).", ge=0, le=MAX_ELEMENTS,
        aliases=("stage3_param_persistence_threshold",),
        stage3_only=True)
    model_persistence_threshold: Int = option(
        sys.maxsize, "Cap on the total elements of persistent (unpartitioned) parameters.",
        ge=0, aliases=("stage3_model_persistence_threshold",), stage3_only=True,
        shown_default="sys.maxsize")
    max_live_parameters: Int = option(
        1_000_000_000, "Cap on gathered parameter elements held at once.", ge=0, le=MAX_ELEMENTS,
        aliases=("stage3_max_live_parameters",), stage3_only=True)
    max_reuse_distance: Int = option(
        1_000_000_000, "Keep a gathered parameter if it is used again after fewer than this many "
        "elements of upcoming fetches (0 keeps nothing).", ge=0, le=MAX_ELEMENTS,
        aliases=("stage3_max_reuse_distance",),
        stage3_only=True)
    gather_16bit_weights_on_model_save: bool = option(
        False, "save_16bit_model() gathers the full 16-bit weights before saving.",
        aliases=("stage3_gather_16bit_weights_on_model_save",), stage3_only=True)
    module_granularity_threshold: Int = option(
        0, "Modules whose parameter elements per layer (itself and the torch leaf modules below it) are "
        "at most this become leaf modules, fetched as one unit; outermost first (0: off).", ge=0, le=MAX_ELEMENTS, aliases=("stage3_module_granularity_threshold",),
        stage3_only=True)
    use_all_reduce_for_fetch_params: bool = option(
        False, "Fetch parameters with an all-reduce of zero-padded buffers instead of "
        "all-gather.", aliases=("stage3_use_all_reduce_for_fetch_params",), stage3_only=True)
    allgather_sequential: bool = option(
        False, "Gather parameters one at a time, without a flattened bucket.",
        aliases=("stage3_allgather_sequential",), stage3_only=True)
    stage3_gather_fp16_weights_on_model_save: Optional[bool] = option(
        None, "Deprecated older name of gather_16bit_weights_on_model_save.",
        deprecated="gather_16bit_weights_on_model_save")
    ignore_unused_parameters: bool = option(
        True, "Stage 2: tolerate parameters that get no gradient (false: raise).")
    legacy_stage1: bool = option(
        False, "Old stage-1 implementation, removed from DeepSpeed in 0.5.9; true is an error.")
    round_robin_gradients: bool = option(
        False, "Stages 1-2 with CPU offload: spread gradient copies over ranks round-robin.")
    zero_hpz_partition_size: Int = option(
        1, "ZeRO++ hpZ: ranks of a node, over which each parameter keeps a secondary partition after its "
        "forward, so the backward gathers within the node (1: off; must divide the world; not with "
        "offload_param).", ge=0, le=2 ** 31 - 1, stage3_only=True)
    zero_quantized_weights: bool = option(
        False, "ZeRO++ qwZ: the forward/backward parameter all-gathers travel as int8 with an fp32 scale per "
        "2048 elements; every rank computes with the dequantized weights, the optimizer steps the exact ones.",
        stage3_only=True)
    zero_quantized_nontrainable_weights: bool = option(
        False, "Stage 3: frozen parameters' pieces kept as int8 with an fp32 scale per 2048 elements (e.g. LoRA "
        "base weights); every rank computes with the dequantized values.", stage3_only=True)
    zero_quantized_gradients: bool = option(
        False, "ZeRO++ qgZ: stage 3's gradient reduce-scatter travels as int4 (an fp32 scale per 512 elements; "
        "1-D parameters unquantized) through one all-to-all, summed in fp32 on arrival.", stage3_only=True)
    zeropp_loco_param: Optional[Dict[str, Any]] = option(
        None, "LoCo-ZeRO++ error-feedback settings, e.g. {\"err_beta\": 0.8, \"reset_T\": 1024}.")
    mics_shard_size: Int = option(
        -1, "MiCS: parameters, gradients and optimizer states are partitioned inside groups of this many "
        "consecutive ranks and replicated across the world / mics_shard_size groups; gradients are "
        "reduce-scattered inside the group, then all-reduced across the replicas (-1 or 0: off; must divide "
        "the world; not with zero_hpz_partition_size, nor with offload_optimizer when there are replicas). "
        "Build the model under zero.MiCS_Init(config_dict_or_path=...) or let initialize partition it.",
        ge=-1, le=2 ** 31 - 1, stage3_only=True)
    mics_hierarchical_params_gather: bool = option(
        False, "MiCS: a shard group spanning several nodes (NDEV_PER_NODE, else LOCAL_WORLD_SIZE ranks each) "
        "gathers parameters in two levels: across nodes among the ranks of the same local index, then inside "
        "the node (same values, fewer bytes across nodes). Needs mics_shard_size spanning whole nodes.",
        stage3_only=True)
    memory_efficient_linear: bool = option(
        True, "Accepted, true or false: zero_ext never patches F.linear, and its hooks free gathered weights "
        "after each module's forward either way (autograd keeps no gathered weight for backward).",
        stage3_only=True,
        ds_note="DeepSpeed's zero.Init swaps F.linear for a variant that saves no gathered weight for backward "
        "(true); false leaves torch's F.linear, as zero_ext always does.")
    pipeline_loading_checkpoint: bool = option(
        False, "Stage 3: the ranks of a host load a checkpoint one after another (local-rank order), "
        "each freeing its files before the next starts: one rank's files in host memory at a time.")
    override_module_apply: bool = option(
        True, "Accepted; zero.Init needs no Module.apply patch (writes after partitioning are exact).",
        stage3_only=True)
    log_trace_cache_warnings: bool = option(
        False, "Log when the recorded parameter-fetch trace is invalidated.", stage3_only=True)
    enable_sanity_checks: bool = option(
        False, "Stage 3: a GatheredParameters block with modifier_rank None (read-only) checks that no rank "
        "modified the parameters in place, and raises RuntimeError on every rank if one did (one small "
        "all-gather at the block's exit).")
    save_muon_momentum_buffer_in_memory: bool = option(
        False, "Muon with offload_optimizer.device nvme (any stage): keep the Muon groups' momentum "
        "buffers in host memory instead of their swap files (the masters and Adam's moments are still "
        "swapped). No effect otherwise.")
    grad_hooks: bool = option(
        True, "Stage 1: reduce gradients from backward hooks as they are produced (false: "
        "after the backward pass).",
        ds_note="Documented in DeepSpeed's config-json.md but not a field of its code, which "
        "rejects the key; zero_ext accepts the documented spelling.")
    leaf_module: LeafModuleConfig = option(
        doc="Modules ZeRO-3 fetches as one unit; see leaf_module below.",
        default_factory=LeafModuleConfig, stage3_only=True)

    # -- deprecated keys -----------------------------------------------------------------------

    @classmethod
    def migrate_raw(cls, data: Dict[str, Any], path: str, report: Any) -> Dict[str, Any]:
        data = dict(data)
        for old, new in _DEPRECATED_OFFLOAD_SWITCHES:
            if old not in data:
                continue
            value = data.pop(old)
            report.deprecated(join_path(path, old), join_path(path, new))
            if not isinstance(value, bool) and value is not None:
                report.problem(join_path(path, old), value, "must be true or false")
            elif value and new in data:
                report.problem(join_path(path, old), value,
                               f"cannot be combined with its replacement {new}; remove {old}")
            elif value:
                data[new] = {"device": "cpu"}
        if "cpu_offload_use_pin_memory" in data:
            _migrate_pin_memory(data, path, report)
        if data.get("elastic_checkpoint") is True:
            report.warnings.append((
                f"{join_path(path, 'elastic_checkpoint')} is deprecated and has no effect: zero_ext checkpoints "
                "load into any world size and ZeRO stage (docs/checkpoints.md, Resharding); remove it",
                ConfigDeprecationWarning))
        old, new = "stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"
        if old in data:
            value = data.pop(old)
            report.deprecated(join_path(path, old), join_path(path, new))
            if new in data:
                report.problem(join_path(path, old), value,
                               f"cannot be combined with its replacement {new}; remove {old}")
            elif value is not None:
                data[new] = value
        param, stage = data.get("offload_param"), data.get("stage", 0)
        if isinstance(param, dict) and str(param.get("device", "none")) not in ("none", "None") \
                and isinstance(stage, int) and stage != 3:
            # DeepSpeed reads offload_param only at stage 3 and ignores it below, so configs carry it there
            report.warning(f"{join_path(path, 'offload_param')} has no effect at ZeRO stage {stage}: parameters "
                           "are offloaded only at stage 3 and stay on the device; set zero_optimization.stage to "
                           "3 to offload them, or remove offload_param")
        return data

    # -- cross-key rules --------------------------------------------------------------------------

    @model_validator(mode="after")
    def _derive_overlap_comm(self) -> "ZeroConfig":
        if self.overlap_comm is None:
            # Bypass validate_assignment: this is a derived default, not a user assignment.
            self.__dict__["overlap_comm"] = self.stage == 3
        return self

    @model_validator(mode="after")
    def _check_rules(self, info: ValidationInfo) -> "ZeroConfig":
        # A section built by its class alone (DeepSpeed's DeepSpeedZeroConfig(cpu_offload_param=True), stage
        # left at its default 0) is checked key by key, as DeepSpeed checks it; the combinations below are
        # checked when the config is loaded (load_config, initialize) and at each later assignment.
        if built_directly(info):
            return self
        problems = list(_offload_rules(self)) + list(_stage_rules(self))
        if problems:
            raise rule_errors(problems)
        return self


def _migrate_pin_memory(data: Dict[str, Any], path: str, report: Any) -> None:
    # DeepSpeed only warns about this key and otherwise ignores it; we apply it to the offload
    # sections, so the user's intent (usually "don't pin") is kept rather than dropped.
    key = "cpu_offload_use_pin_memory"
    value = data.pop(key)
    report.deprecated(join_path(path, key), join_path(path, "offload_*.pin_memory"))
    if not isinstance(value, bool):
        if value is not None:
            report.problem(join_path(path, key), value, "must be true or false")
        return
    targets = [s for s in ("offload_optimizer", "offload_param") if isinstance(data.get(s), dict)]
    if not targets:
        report.warning(f"{join_path(path, key)} has no effect: no offload_optimizer/offload_param section "
                       "is configured")
    for section in targets:
        given = data[section]
        if "pin_memory" in given and given["pin_memory"] != value:
            report.problem(join_path(path, key), value,
                           f"conflicts with {join_path(path, section)}.pin_memory = {given['pin_memory']}; "
                           f"remove {key}")
        else:
            data[section] = {**given, "pin_memory": value}


def _offload_rules(z: ZeroConfig):
    """Where offload is allowed. Yields (key, value, message)."""
    optim = z.offload_optimizer  # (offload_param below stage 3 only warns: migrate_raw)
    if optim is None:
        return
    if optim.device != OffloadDevice.none and z.stage == 0:
        yield ("offload_optimizer.device", optim.device,
               "optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0)")
    if optim.ratio < 1.0 and z.stage != 3:
        yield ("offload_optimizer.ratio", optim.ratio,
               f"partial offload (ratio < 1) is only supported with ZeRO stage 3 (stage is "
               f"{z.stage})")
    if optim.ratio < 1.0 and optim.device == OffloadDevice.none:
        yield ("offload_optimizer.ratio", optim.ratio,
               'partial offload needs offload_optimizer.device "cpu" or "nvme"')
    if optim.super_offload and z.stage != 3:
        yield ("offload_optimizer.super_offload", True,
               f"super_offload is only supported with ZeRO stage 3 (stage is {z.stage})")


def _stage_rules(z: ZeroConfig):
    """Keys that only work at some stages, or not at all. Yields (key, value, message)."""
    if z.pipeline_loading_checkpoint and z.stage != 3:
        yield ("pipeline_loading_checkpoint", True,
               f"only supported with ZeRO stage 3 (stage is {z.stage})")
    if z.legacy_stage1:
        yield ("legacy_stage1", True,
               "the legacy stage-1 implementation was removed (DeepSpeed >= 0.5.9 rejects it "
               "too); remove the key")
    if z.stage == 3:
        yield from _mics_rules(z)
    if z.stage in (1, 2) and z.allgather_bucket_size % 2:
        yield ("allgather_bucket_size", z.allgather_bucket_size,
               "allgather_bucket_size must be a multiple of nccl_start_alignment_factor, i.e. a multiple of 2 "
               "(16-bit all-gather buckets start 4-byte aligned)")


def _mics_rules(z: ZeroConfig):
    """MiCS's combinations (those needing the world size are checked by the builder, zero/mics.py)."""
    mics = z.mics_shard_size > 0
    if z.mics_hierarchical_params_gather and not mics:
        yield ("mics_hierarchical_params_gather", True,
               "has no effect without MiCS: set mics_shard_size (> 0) or remove the key")
    if mics and z.zero_hpz_partition_size > 1:
        yield ("mics_shard_size", z.mics_shard_size,
               f"MiCS and hpZ (zero_hpz_partition_size = {z.zero_hpz_partition_size}) both choose where parameters "
               "are gathered from; use one of them")
    if mics and z.mics_hierarchical_params_gather and z.zero_quantized_weights:
        yield ("mics_hierarchical_params_gather", True,
               "the two-level gather moves exact pieces; it does not combine with zero_quantized_weights (qwZ): "
               "turn one of them off")


def stage3_only_keys_given(z: ZeroConfig) -> Tuple[str, ...]:
    """Stage-3-only keys the user set although stage < 3 (they have no effect). sub_group_size also
    slices the stage-1/2 partitions that offload_optimizer.device "nvme" swaps."""
    if z.stage == 3:
        return ()
    nvme = z.offload_optimizer is not None and z.offload_optimizer.device == "nvme"
    return tuple(k for k in sorted(z.model_fields_set)
                 if field_extra(ZeroConfig, k).get("stage3_only") and not (nvme and k == "sub_group_size"))
