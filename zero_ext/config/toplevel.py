"""The whole config: top-level keys and sections (``DeepSpeedConfig``).

Top-level names and defaults follow DeepSpeed's ``runtime/config.py`` and ``runtime/constants.py``
(0.19.x). DeepSpeed reads top-level keys with ``dict.get`` and silently ignores unknown ones;
here unknown keys are errors with a suggestion (see docs/config.md).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, ClassVar, Dict, Optional, Tuple

from pydantic import PrivateAttr, field_validator, model_validator

from . import batch
from .aio import AioConfig
from .base import ConfigModel, Float, Int, lower_str, option, rule_errors
from .errors import warn
from .optim_params import adagrad_rules
from .optimizer import NOT_WITH_ZERO, OptimizerConfig
from .precision import BF16Config, DataTypesConfig, FP16Config
from .scheduler import SchedulerConfig
from .sections import (IGNORED_SECTIONS, ActivationCheckpointingConfig, CheckpointConfig, CompileConfig, FeatureSection,
                       ProgressiveLayerDropConfig, TorchAutocastConfig)
from .zero import ZeroConfig

logger = logging.getLogger("zero_ext.config")


def _comm_dtype(value: Any) -> Any:
    value = lower_str(value)
    if value is None or value in ("fp16", "bf16", "fp32"):
        return value
    raise ValueError('must be "fp16", "bf16" or "fp32" (or null: same as the gradients)')


class DeepSpeedConfig(ConfigModel):
    """A validated DeepSpeed config. Build it with :func:`zero_ext.config.load_config`."""

    ignored_sections_table: ClassVar[Dict[str, str]] = IGNORED_SECTIONS

    # -- batch -----------------------------------------------------------------------------------
    train_batch_size: Optional[Int] = option(
        None, "Samples per optimizer step over all ranks: micro batch * accumulation steps * "
        "data-parallel world size. Any two of the three derive the third.", gt=0)
    train_micro_batch_size_per_gpu: Optional[Int] = option(
        None, "Samples per rank per forward/backward.", gt=0)
    gradient_accumulation_steps: Optional[Int] = option(
        None, "Micro batches accumulated before each optimizer step.", gt=0)
    managed_gradient_accumulation: bool = option(
        True, "The engine decides the accumulation boundary (false: every step() is one).")
    # -- sections --------------------------------------------------------------------------------
    zero_optimization: ZeroConfig = option(doc="ZeRO settings; see below.",
                                           default_factory=ZeroConfig)
    fp16: FP16Config = option(doc="fp16 mixed precision; see below.", default_factory=FP16Config)
    bf16: BF16Config = option(doc="bf16 mixed precision; see below.",
                              default_factory=BF16Config, aliases=("bfloat16",))
    optimizer: Optional[OptimizerConfig] = option(None, "Optimizer to build; see below.")
    scheduler: Optional[SchedulerConfig] = option(None, "LR scheduler to build; see below.")
    aio: AioConfig = option(doc="NVMe I/O tuning; see below.", default_factory=AioConfig)
    checkpoint: CheckpointConfig = option(doc="Checkpointing; see below.",
                                          default_factory=CheckpointConfig)
    data_types: DataTypesConfig = option(doc="Accumulation/parameter dtypes; see below.",
                                         default_factory=DataTypesConfig)
    activation_checkpointing: ActivationCheckpointingConfig = option(
        doc="deepspeed.checkpointing's settings; see below.", default_factory=ActivationCheckpointingConfig)
    # -- gradients -------------------------------------------------------------------------------
    gradient_clipping: Float = option(
        1.0, "Clip the global gradient norm to this value; 0 disables clipping.", ge=0.0,
        ds_note="Default changed from 0.0 (off) to 1.0 in DeepSpeed 0.19.3.")
    prescale_gradients: bool = option(False, "Divide gradients before (not after) reduction.")
    gradient_predivide_factor: Float = option(
        1.0, "Divide gradients by this before reduction and by world_size/factor after.", gt=0.0)
    gradient_allreduce_op: str = option(
        "mean", 'How ranks\' gradients combine: "mean" (averaged) or "sum" (added up, as if the '
        'losses were summed over ranks); "sum" needs ZeRO stage 0-2.')
    communication_data_type: Optional[str] = option(
        None, "Dtype of gradient communication: fp16, bf16 or fp32 (null: the gradients').")
    seq_parallel_communication_data_type: Optional[str] = option(
        "fp32", "Dtype of sequence-parallel communication.")
    sparse_gradients: bool = option(False, "Reduce embedding gradients as sparse tensors.")
    disable_allgather: bool = option(False, "Legacy: broadcast instead of all-gather.")
    # -- optimizer policy ------------------------------------------------------------------------
    zero_allow_untested_optimizer: bool = option(
        False, "Allow a client optimizer ZeRO was not tested with.")
    zero_force_ds_cpu_optimizer: bool = option(
        True, "With optimizer offload, require DeepSpeed's CPU optimizer (false: allow a "
        "client optimizer).")
    # -- logging / data --------------------------------------------------------------------------
    steps_per_print: Optional[Int] = option(
        None, "Log progress every N optimizer steps (null or Infinity: never).", ge=1)
    wall_clock_breakdown: bool = option(
        False, "Time forward, backward (autograd pass, gradient reduction) and step; rank 0 prints "
        "DeepSpeed's `time (ms) | fwd: ...` lines every steps_per_print optimizer steps (every step "
        "when unset); engine.get_wall_clock_timers() returns them.",
        ds_note="DeepSpeed prints the micro-step line at every step() call and the global line at "
        "every optimizer step.")
    log_level: Optional[str] = option(
        None, "Level of the zero_ext logger (deepspeed.utils.logger): debug, info, warning, error or critical "
        "(any case), set when the engine is built; null leaves it as it is.")
    dataloader_drop_last: bool = option(
        False, "The engine's data loader drops the last incomplete batch.")
    graph_harvesting: bool = option(False, "Capture the step in CUDA graphs.")
    use_data_before_expert_parallelism: bool = option(
        False, "MoE layers (deepspeed.moe.layer.MoE): lay the expert-data-parallel groups out before the "
        "expert-parallel ones (DeepSpeed's other rank layout).")
    sequence_parallel_size: Optional[Int] = option(
        None, "Sequence-parallel (Ulysses) group size.", ge=1)
    data_parallel_size: Optional[Int] = option(
        None, "Data-parallel size of the device mesh (with sequence_parallel_size).", ge=1)
    # -- other subsystems (accepted; switching one on is refused by the engine) -----------------
    amp: FeatureSection = option(doc="NVIDIA Apex AMP.", default_factory=FeatureSection)
    torch_autocast: TorchAutocastConfig = option(doc="torch.autocast mixed precision.",
                                                 default_factory=TorchAutocastConfig)
    elasticity: FeatureSection = option(doc="Elastic training (overrides batch sizes).",
                                        default_factory=FeatureSection)
    compile: CompileConfig = option(doc="DeepCompile.", default_factory=CompileConfig)
    hybrid_engine: FeatureSection = option(doc="RLHF hybrid engine.",
                                           default_factory=FeatureSection)
    progressive_layer_drop: ProgressiveLayerDropConfig = option(
        doc="Progressive layer dropping.", default_factory=ProgressiveLayerDropConfig)
    curriculum_learning: FeatureSection = option(doc="Legacy curriculum learning.",
                                                 default_factory=FeatureSection)
    data_efficiency: FeatureSection = option(doc="Data efficiency library.",
                                             default_factory=FeatureSection)
    quantize_training: FeatureSection = option(doc="MoQ quantize-aware training.",
                                               default_factory=FeatureSection)
    compression_training: Optional[Dict[str, Any]] = option(None, "Compression library.")
    weight_quantization: Optional[Dict[str, Any]] = option(None, "Inference weight "
                                                           "quantization.")
    tensor_parallel: Optional[Dict[str, Any]] = option(None, "AutoTP tensor parallelism.")
    expert_parallel: Optional[Dict[str, Any]] = option(None, "AutoEP expert parallelism.")
    allgather_size: Optional[Int] = option(
        None, "Deprecated: bucket size of the legacy `\"zero_optimization\": true` form.",
        deprecated="zero_optimization.allgather_bucket_size", ge=0)

    _raw: Dict[str, Any] = PrivateAttr(default_factory=dict)
    _auto_resolved: Dict[str, Any] = PrivateAttr(default_factory=dict)
    _ignored: Dict[str, Any] = PrivateAttr(default_factory=dict)
    _given_batch: Tuple[Optional[int], Optional[int], Optional[int]] = PrivateAttr(
        default=(None, None, None))
    _world_size: Optional[int] = PrivateAttr(default=None)

    # -- value normalisation -------------------------------------------------------------------

    @field_validator("communication_data_type", "seq_parallel_communication_data_type",
                     mode="before")
    @classmethod
    def _comm_dtype(cls, value: Any) -> Any:
        return _comm_dtype(value)

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _never_print(cls, value: Any) -> Any:
        # accelerate writes float("inf") to mean "never" (DeepSpeed compares, so inf never matches)
        return None if isinstance(value, float) and value == float("inf") else value

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _reduce_op(cls, value: Any) -> Any:
        value = lower_str(value)
        if value not in ("mean", "sum"):
            raise ValueError('Invalid gradient_allreduce_op: must be "mean" (average over ranks) or "sum"')
        return value

    # -- deprecated legacy form ------------------------------------------------------------------

    @classmethod
    def migrate_raw(cls, data: Dict[str, Any], path: str, report: Any) -> Dict[str, Any]:
        data = dict(data)
        zero = data.get("zero_optimization")
        size = data.pop("allgather_size", None)
        if isinstance(zero, bool):
            # DeepSpeed's oldest form: true means stage 1 (bucket from top-level allgather_size).
            report.deprecated("zero_optimization: true/false",
                              'zero_optimization: {"stage": N, ...}')
            data["zero_optimization"] = {"stage": int(zero)}
            if zero:
                data["zero_optimization"]["allgather_bucket_size"] = (
                    size if size is not None else 500_000_000)
        elif size is not None:
            report.problem("allgather_size", size, "is only read with the legacy form "
                           '"zero_optimization": true; use zero_optimization.'
                           "allgather_bucket_size")
        return data

    # -- cross-section rules ---------------------------------------------------------------------

    @model_validator(mode="after")
    def _check_rules(self) -> "DeepSpeedConfig":
        problems = list(_precision_rules(self)) + list(_reduction_rules(self)) + list(_logging_rules(self))
        _warn_unused_with_sum(self)
        if self.optimizer is not None and self.optimizer.type in NOT_WITH_ZERO \
                and self.zero_optimization.stage > 0:
            problems.append(("optimizer.type", self.optimizer.type,
                             "is not compatible with ZeRO (stage >= 1); DeepSpeed refuses it "
                             "too"))
        # a static loss_scale of 1 scales nothing, so DeepSpeed's division of the update by it is exact
        if self.optimizer is not None and self.optimizer.type == "muon" and self.fp16.enabled \
                and self.fp16.loss_scale != 1.0:
            problems.append(("optimizer.type", "muon", "Muon with fp16 loss scaling is not supported (the "
                             "orthogonalized update does not scale with the loss); use bf16 or fp32, or fp16 "
                             "with a static fp16.loss_scale of 1"))
        if self.optimizer is not None and self.optimizer.type == "adagrad":
            oc = self.zero_optimization.offload_optimizer
            offloaded = oc is not None and oc.device != "none" and self.zero_optimization.stage > 0
            problems += [(f"optimizer.{k}", v, m)
                         for k, v, m in adagrad_rules(self.optimizer.params, offloaded)]
        if problems:
            raise rule_errors(problems)
        return self

    # -- results of loading --------------------------------------------------------------------

    def model_post_init(self, context: Any) -> None:
        # resolve_batch always starts from the values as validated, not from earlier results.
        self._given_batch = self.given_batch()

    def record_load(self, raw: Dict[str, Any], ignored: Dict[str, Any],
                    auto_resolved: Dict[str, Any]) -> None:
        """Called once by load_config: keep what the schema alone does not hold."""
        self._raw = raw
        self._ignored = dict(ignored)
        self._auto_resolved = dict(auto_resolved)

    def given_batch(self) -> Tuple[Optional[int], Optional[int], Optional[int]]:
        """(train_batch_size, micro batch, accumulation steps) as currently set (None: absent)."""
        return (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                self.gradient_accumulation_steps)

    @property
    def raw(self) -> Dict[str, Any]:
        """The config exactly as given (a dict; a deep copy, so mutating it changes nothing)."""
        return copy.deepcopy(self._raw)

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level key of the config as given (a deep copy), as on DeepSpeed's ``engine.config``,
        which is the user's dict: transformers' Trainer reads
        ``engine.config.get("zero_optimization", {}).get("stage")``. Batch keys give their resolved values."""
        if key in batch.BATCH_KEYS and self.__dict__.get(key) is not None:
            return self.__dict__[key]
        return copy.deepcopy(self._raw.get(key, default))

    @property
    def auto_resolved(self) -> Dict[str, Any]:
        """Key path -> value for every key given as "auto" (batch keys after resolve_batch)."""
        return dict(self._auto_resolved)

    @property
    def ignored_sections(self) -> Dict[str, Any]:
        """Top-level sections of DeepSpeed subsystems zero_ext ignores, as given."""
        return dict(self._ignored)

    @property
    def world_size(self) -> Optional[int]:
        """The data-parallel world size the batch was resolved for (None until then)."""
        return self._world_size

    def resolve_batch(self, world_size: int, *, log: bool = True) -> Tuple[int, int, int]:
        """Derive/check the batch triple for ``world_size`` data-parallel ranks.

        Sets and returns (train_batch_size, train_micro_batch_size_per_gpu,
        gradient_accumulation_steps). Always starts from the values as given, so calling it
        again with another world size re-derives. Raises ConfigError. Batch keys given as
        "auto" are logged with their values (``log=False``: the caller logs).
        """
        auto = [k for k in batch.BATCH_KEYS if k in self._auto_resolved]
        triple = batch.resolve_batch(*self._given_batch, world_size, auto=auto)
        for key, value in zip(batch.BATCH_KEYS, triple):
            self.__dict__[key] = value
            if key in auto:
                self._auto_resolved[key] = value
        self._world_size = world_size
        if log and auto:
            shown = ", ".join(f"{k}={self._auto_resolved[k]}" for k in auto)
            logger.info('batch sizes given as "auto" resolved for world_size %d: %s',
                        world_size, shown)
        return triple

    @property
    def zero_enabled(self) -> bool:
        return self.zero_optimization.stage > 0

    @property
    def precision(self) -> str:
        """"fp16", "bf16" or "fp32": the training precision the config selects."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"


def _precision_rules(cfg: DeepSpeedConfig):
    stage = cfg.zero_optimization.stage
    if cfg.fp16.enabled and cfg.bf16.enabled:
        yield ("bf16.enabled", True, "fp16 and bf16 cannot both be enabled; turn one off")
    for section, key in (("fp16", "fp16_master_weights_and_grads"),
                         ("bf16", "bf16_master_weights_and_grads"),
                         ("bf16", "bf16_optimizer_states")):
        if getattr(getattr(cfg, section), key) and stage == 0:
            yield (f"{section}.{key}", True, "needs ZeRO stage 1, 2 or 3 (stage is 0)")
    wanted = cfg.data_types.param_dtype
    if wanted is not None and wanted != cfg.precision:
        yield ("data_types.param_dtype", wanted,
               f"conflicts with the training precision the config enables ({cfg.precision}): parameters are "
               "cast to the fp16/bf16 mode's dtype; enable the matching fp16/bf16 section or remove "
               "data_types.param_dtype")
    autocast = cfg.torch_autocast
    if autocast.enabled and cfg.zero_optimization.zero_quantized_weights:
        yield ("torch_autocast.enabled", True,
               "cannot be combined with zero_optimization.zero_quantized_weights: the autocast parameters are "
               "all-gathered in the autocast dtype, qwZ gathers int8 (DeepSpeed refuses it too); turn one off")
    if autocast.enabled and autocast.dtype == "fp16" and cfg.fp16.enabled:
        yield ("torch_autocast.dtype", "fp16",
               "fp16 autocast scales the loss with its own GradScaler-style scaler, and fp16.enabled scales it "
               "again (DeepSpeed then divides the gradients by both); use fp16.enabled or an fp16 "
               "torch_autocast, not both")


LOG_LEVEL_NAMES = ("debug", "info", "warning", "error", "critical")  # (utils/logging.py maps them)


def _logging_rules(cfg: DeepSpeedConfig):
    if cfg.log_level is not None and str(cfg.log_level).lower() not in LOG_LEVEL_NAMES:
        yield ("log_level", cfg.log_level, f"must be one of {', '.join(LOG_LEVEL_NAMES)} (any case)")


def _warn_unused_with_sum(cfg: DeepSpeedConfig) -> None:
    """gradient_allreduce_op "sum" adds the ranks' gradients up and never divides them, so
    prescale_gradients / gradient_predivide_factor do nothing there; DeepSpeed accepts them silently
    (configs written for "mean" keep them), zero_ext accepts them and says they are unused."""
    if cfg.gradient_allreduce_op != "sum":
        return
    for key, unused in (("prescale_gradients", cfg.prescale_gradients),
                        ("gradient_predivide_factor", cfg.gradient_predivide_factor != 1.0)):
        if unused:
            warn(f'{key} = {getattr(cfg, key)!r} has no effect with gradient_allreduce_op "sum" (the gradients '
                 "are added up, never divided); it is ignored")


def _reduction_rules(cfg: DeepSpeedConfig):
    zero = cfg.zero_optimization
    if not cfg.managed_gradient_accumulation and zero.overlap_comm and zero.stage < 2:
        yield ("zero_optimization.overlap_comm", True, "with managed_gradient_accumulation false, overlap_comm "
               f"only with ZeRO stage 2 or 3 (stage {zero.stage} reduces in step(), with nothing to overlap)")
    if cfg.gradient_allreduce_op == "sum":
        if zero.stage == 3:
            yield ("gradient_allreduce_op", "sum", 'is not supported with ZeRO stage 3; use "mean"')
        if zero.zenflow is not None:
            yield ("gradient_allreduce_op", "sum", 'is not supported with ZenFlow; use "mean"')
        if cfg.compile.deepcompile:
            yield ("gradient_allreduce_op", "sum", 'is not supported with DeepCompile; use "mean"')
    if zero.stage >= 2 and zero.reduce_scatter:
        if cfg.gradient_predivide_factor != 1.0:
            yield ("gradient_predivide_factor", cfg.gradient_predivide_factor,
                   f"must be 1.0 with ZeRO stage {zero.stage} and reduce_scatter; set "
                   "zero_optimization.reduce_scatter to false to use it")
        if cfg.prescale_gradients:
            yield ("prescale_gradients", True,
                   f"is not supported with ZeRO stage {zero.stage} and reduce_scatter; set "
                   "zero_optimization.reduce_scatter to false to use it")

