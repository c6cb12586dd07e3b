"""The process-wide settings of activation checkpointing: ``configure``, ``is_configured``, and the
model-parallel group a partition is taken over.

DeepSpeed keeps these as module globals that ``configure`` sets; one ``Settings`` object here plays
that part (``current()``), replaced whole by each ``configure`` so that a half-applied call never
shows.
"""
import dataclasses
import logging
from typing import Any, Optional

from .. import comm
from ..config import ConfigError, load_config
from ..config.sections import ActivationCheckpointingConfig

logger = logging.getLogger("zero_ext.checkpointing")


class CheckpointingConfigError(ConfigError, AssertionError):
    """Settings of activation checkpointing that do not go together: a ConfigError (ValueError), and an
    AssertionError, which is what DeepSpeed's configure raises for them."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What ``checkpoint()`` does with the inputs it keeps for recomputation."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    mpu: Any = None  # the model-parallel unit given to configure (kept for later calls, as DeepSpeed does)
    configured: bool = False  # the user called configure() (is_configured())
    from_engine: bool = False  # set by initialize from its config's section (is_configured() stays False)

    @property
    def partition_group(self):
        """(group, size, rank) a saved input is partitioned over: the mpu's model-parallel group when
        partitioning is on and an mpu was given, else this rank alone (size 1)."""
        if not self.partition_activations or self.mpu is None:
            return None, 1, 0
        mpu = self.mpu
        if hasattr(mpu, "get_tensor_model_parallel_rank"):  # Megatron's newer names
            return (mpu.get_tensor_model_parallel_group(), int(mpu.get_tensor_model_parallel_world_size()),
                    int(mpu.get_tensor_model_parallel_rank()))
        return (mpu.get_model_parallel_group(), int(mpu.get_model_parallel_world_size()),
                int(mpu.get_model_parallel_rank()))

    @property
    def keeps_copies(self) -> bool:
        """Whether checkpoint() keeps its own copies of the inputs (partitions or host copies) rather
        than the inputs themselves."""
        return self.partition_activations or self.cpu_checkpointing


_current = Settings()


def current() -> Settings:
    return _current


def _section(deepspeed_config) -> ActivationCheckpointingConfig:
    """The activation_checkpointing section of a config given as a path, dict, JSON text or loaded config."""
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    loaded = getattr(deepspeed_config, "config", deepspeed_config)  # runtime.config.DeepSpeedConfig's model
    if not hasattr(loaded, "activation_checkpointing"):
        loaded = load_config(deepspeed_config)
    return loaded.activation_checkpointing


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: the defaults, then the config's
    ``activation_checkpointing`` section (a path, dict or JSON text), then every argument that is not None.
    ``mpu_`` (get_model_parallel_rank/world_size/group) is the group ``partition_activations`` splits over;
    one given earlier is kept when this call gives none."""
    global _current
    fields = {}
    if deepspeed_config is not None:
        fields = _section(deepspeed_config).model_dump()
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    fields.update({k: v for k, v in given.items() if v is not None})
    settings = Settings(**{k: v for k, v in fields.items()}, mpu=mpu_ if mpu_ is not None else _current.mpu,
                        configured=True)
    _check(settings)
    _current = settings
    _log(settings)


def configure_from_engine(section: ActivationCheckpointingConfig, given: bool) -> None:
    """initialize's part: a config that writes an ``activation_checkpointing`` section (``given``) sets
    checkpoint()'s behaviour unless the user configured it already (their call wins: DeepSpeed reads the
    section only in configure(), and a later engine must not undo an explicit configure)."""
    global _current
    if not given or _current.configured:
        return
    settings = Settings(**section.model_dump(), mpu=_current.mpu, from_engine=True)
    _check(settings)
    _current = settings
    _log(settings)


def reset_settings() -> None:
    """Back to the state before any configure() (tests; DeepSpeed has no such call)."""
    global _current
    _current = Settings()


def _check(s: Settings) -> None:
    if s.contiguous_memory_optimization and not s.partition_activations:
        raise CheckpointingConfigError(
            "activation checkpointing: contiguous_memory_optimization needs partition_activations (it copies the "
            "partitions into preallocated buffers); turn partition_activations on, or "
            "contiguous_memory_optimization off")
    if s.contiguous_memory_optimization and s.number_checkpoints is None:
        raise CheckpointingConfigError(
            "activation checkpointing: contiguous_memory_optimization needs number_checkpoints, the number of layers "
            "(checkpointed calls per forward) that sizes its buffers; set it (num_checkpoints= in configure)")
    if s.mpu is not None:
        for name in ("get_model_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_group"):
            if not hasattr(s.mpu, name) and not hasattr(s.mpu, name.replace("get_model", "get_tensor_model")):
                raise TypeError(f"deepspeed.checkpointing.configure: mpu_ has no {name}(); pass an object with "
                                "get_model_parallel_rank/world_size/group (Megatron's mpu), or None")


def _log(s: Settings) -> None:
    if comm.is_initialized() and comm.get_rank() != 0:
        return
    _, size, _ = s.partition_group
    logger.info("activation checkpointing: partition_activations %s (over %d rank%s), cpu_checkpointing %s, "
                "contiguous_memory_optimization %s with %s checkpoints, synchronize %s, profile %s",
                s.partition_activations, size, "" if size == 1 else "s", s.cpu_checkpointing,
                s.contiguous_memory_optimization, s.number_checkpoints, s.synchronize_checkpoint_boundary, s.profile)
    if s.partition_activations and s.mpu is None:
        logger.info("activation checkpointing: partition_activations splits over the model-parallel group of the "
                    "mpu given to configure(); none was given, so saved inputs are kept whole (a data-parallel "
                    "rank's activations are its own, as in DeepSpeed without an mpu)")


def deepspeed_globals(name: str):
    """DeepSpeed's module globals of the settings (``checkpointing.PARTITION_ACTIVATIONS``, ...), read-only."""
    s = _current
    table = {"PARTITION_ACTIVATIONS": s.partition_activations,
             "CONTIGUOUS_CHECKPOINTING": s.contiguous_memory_optimization, "CPU_CHECKPOINT": s.cpu_checkpointing,
             "SYNCHRONIZE": s.synchronize_checkpoint_boundary, "PROFILE_TIME": s.profile,
             "num_layers": s.number_checkpoints, "mpu": s.mpu, "deepspeed_checkpointing_enabled": s.configured}
    if name not in table:
        raise AttributeError(name)
    return table[name]


def is_configured() -> bool:
    """True once configure() was called (DeepSpeed's ``is_configured``; a section applied by initialize
    does not count, as DeepSpeed's engine never calls configure)."""
    return _current.configured
