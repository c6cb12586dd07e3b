"""Smaller top-level sections: ``checkpoint``, and the sections of other DeepSpeed subsystems.

Other subsystems come in two kinds:

* :data:`IGNORED_SECTIONS` — monitoring, profiling and tooling (tensorboard, flops_profiler, ...).
  Ignoring them cannot change what training computes, so they are accepted with one warning and
  kept aside in ``cfg.ignored_sections``.
* Feature sections that *would* change training when switched on (elasticity, amp, compile, ...).
  They are typed loosely (their own keys are not checked) so that a file with them loads; turning
  one on is refused by :func:`~.unimplemented.reject_unimplemented`.
"""

from __future__ import annotations

from typing import Any, List, Optional

from pydantic import ConfigDict, field_validator

from .base import ConfigModel, Float, Int, option, upper_str


class ParallelWriteConfig(ConfigModel):
    """Pipeline-parallel checkpoint writing."""

    pipeline_stage: bool = option(False, "Write checkpoints per pipeline stage in parallel.")


class CheckpointWriterConfig(ConfigModel):
    """DeepSpeed's fast checkpoint writer."""

    type: str = option("FAST", "Writer: FAST, PYTHON or MOCK (case-insensitive).")
    io_buffer_size: Int = option(64 * 1024 ** 2, "Bytes of the I/O buffer.", gt=0)
    io_buffer_double: bool = option(True, "Double-buffer writes.")
    io_multiplier: Int = option(1, "I/O parallelism multiplier.", ge=1)
    show_statistics: bool = option(False, "Print write statistics.")
    data_parallel: Optional[str] = option(None, "Writers per data-parallel group: REPLICA, "
                                          "SOCKET or MACHINE (case-insensitive).")
    decoupled: bool = option(False, "Write from a separate process.")

    @field_validator("type", "data_parallel", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return upper_str(value)

    @field_validator("type")
    @classmethod
    def _writer_type(cls, value: str) -> str:
        if value not in ("FAST", "PYTHON", "MOCK"):
            raise ValueError('must be "FAST", "PYTHON" or "MOCK"')
        return value

    @field_validator("data_parallel")
    @classmethod
    def _unit(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value not in ("REPLICA", "SOCKET", "MACHINE"):
            raise ValueError('must be "REPLICA", "SOCKET" or "MACHINE"')
        return value


class CheckpointConfig(ConfigModel):
    """Checkpoint saving and loading."""

    tag_validation: str = option(
        "WARN", "Check that all ranks save/load the same checkpoint tag: WARN, IGNORE or FAIL "
        "(case-insensitive).")
    load_universal: bool = option(False, "Load a universal (topology-independent) checkpoint.")
    use_node_local_storage: bool = option(
        False, "Each node saves to its own local storage (not a shared file system).")
    parallel_write: ParallelWriteConfig = option(
        doc="Pipeline-parallel writing.", default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = option(
        True, "Serialize tensors with torch.save's zipfile format.")
    writer: Optional[CheckpointWriterConfig] = option(None, "Fast checkpoint writer settings.")

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _mode(cls, value: Any) -> Any:
        value = upper_str(value)
        if value not in ("WARN", "IGNORE", "FAIL"):
            raise ValueError('must be "WARN", "IGNORE" or "FAIL"')
        return value


class ActivationCheckpointingConfig(ConfigModel):
    """Activation checkpointing (``deepspeed.checkpointing``): what ``checkpoint()`` keeps of each
    checkpointed call's inputs until its recomputation in backward."""

    partition_activations: bool = option(
        False, "Keep only this rank's 1/N of each saved input, N being the model-parallel group's size "
        "(the mpu given to checkpointing.configure; none: N = 1); backward all-gathers it.")
    contiguous_memory_optimization: bool = option(
        False, "Copy the kept partitions into preallocated buffers, one per input position holding "
        "number_checkpoints partitions (needs partition_activations).")
    number_checkpoints: Optional[Int] = option(
        None, "Checkpointed calls per forward: the buffers' length for contiguous_memory_optimization.",
        ge=1)
    cpu_checkpointing: bool = option(
        False, "Keep the saved inputs (partitions) in host memory; backward copies them back.")
    synchronize_checkpoint_boundary: bool = option(
        False, "Synchronize the accelerator before and after each checkpointed forward and backward.")
    profile: bool = option(False, "Log the forward and backward time of each checkpointed call.")


class FeatureSection(ConfigModel):
    """A DeepSpeed feature zero_ext does not implement; only ``enabled`` is read here."""

    model_config = ConfigDict(extra="allow")

    enabled: bool = option(False, "Turn the feature on (refused by zero_ext for now).")


#: DeepSpeed's DtypeEnum spellings of the two autocast dtypes (torch.autocast takes no others here).
AUTOCAST_DTYPES = {"torch.bfloat16": "bf16", "bf16": "bf16", "bfloat16": "bf16",
                   "torch.float16": "fp16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}


class TorchAutocastConfig(ConfigModel):
    """torch.autocast around the engine's forward pass (DeepSpeed's ``torch_autocast``); the parameters
    of lower-precision-safe modules have their gradients reduced (and, at ZeRO-3, are all-gathered) in
    the autocast dtype (docs/precision.md, "torch.autocast")."""

    enabled: bool = option(False, "Run the forward pass under torch.autocast.")
    dtype: Optional[str] = option(
        None, 'Autocast dtype: "bf16" / "bfloat16" / "torch.bfloat16" or "fp16" / "float16" / "half" / '
        '"torch.float16" (null: the device\'s autocast default, bf16 on CPU, fp16 on CUDA). fp16 scales '
        "the loss as torch.amp.GradScaler does.")
    lower_precision_safe_modules: Optional[List[str]] = option(
        None, 'Module classes ("package.Class", exact class match) whose parameters are communicated in '
        "the autocast dtype (null: torch.nn.Linear, Conv1d, Conv2d, Conv3d).")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        if value is None:
            return None
        name = str(value).strip().lower() if isinstance(value, str) else str(value)
        if name not in AUTOCAST_DTYPES:
            raise ValueError(f'must name bf16 or fp16 for torch.autocast ("bfloat16", "torch.bfloat16", "fp16", '
                             f'"float16", "half", ...), got {value!r}')
        return AUTOCAST_DTYPES[name]

    @field_validator("lower_precision_safe_modules", mode="before")
    @classmethod
    def _modules(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError('must be a list of class names as strings, e.g. ["torch.nn.Linear", '
                             f'"mypackage.MyLinear"], got {value!r}')
        bad = [v for v in value if "." not in v.strip(".")]
        if bad:
            raise ValueError(f'{bad[0]!r} is not a qualified class name: write "package.module.Class"')
        return list(value)


class ProgressiveLayerDropConfig(ConfigModel):
    """Progressive layer dropping."""

    enabled: bool = option(False, "Turn progressive layer drop on.")
    theta: Float = option(1.0, "Final keep probability.")
    gamma: Float = option(0.001, "Decay rate of the keep probability.")


class CompileConfig(ConfigModel):
    """DeepCompile and related compiler settings; only ``deepcompile`` is read here."""

    model_config = ConfigDict(extra="allow")

    deepcompile: bool = option(False, "Compile the training step with DeepCompile.")


#: Top-level sections about DeepSpeed subsystems that cannot change what training computes.
#: Accepted with one warning (unless disabled) and kept in ``cfg.ignored_sections``.
IGNORED_SECTIONS = {
    "tensorboard": "TensorBoard monitor",
    "wandb": "Weights & Biases monitor",
    "csv_monitor": "CSV monitor",
    "comet": "Comet monitor",
    "flops_profiler": "FLOPs profiler",
    "comms_logger": "communication logger",
    "timers": "throughput timers; engine.tput_timer reads throughput.enabled and synchronized",
    "autotuning": "autotuner",
    "model_info": "autotuner model description",
    "nebula": "Nebula checkpoint service",
    "datastates_ckpt": "DataStates asynchronous checkpointing",
    "sparse_attention": "sparse attention kernels",
    "pipeline": "pipeline-parallel engine (PipelineModule)",
    "eigenvalue": "eigenvalue computation for MoQ",
    "memory_breakdown": "memory usage printouts",
    "dump_state": "state dump printouts",
    "vocabulary_size": "tensor-core alignment hint",
}


def section_is_disabled(value: Any) -> bool:
    """An ignored section written as off (``{"enabled": false}`` or ``false``) loses nothing."""
    if value is False or value is None:
        return True
    return isinstance(value, dict) and value.get("enabled") is False
