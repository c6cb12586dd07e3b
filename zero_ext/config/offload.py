"""``zero_optimization.offload_param`` and ``zero_optimization.offload_optimizer``.

Field names, defaults and ranges follow DeepSpeed's ``deepspeed/runtime/zero/offload_config.py``
(0.19.x: ``pin_memory`` defaults to true since 0.19.5, ``device`` to "none").
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from pydantic import model_validator

from .base import MAX_ELEMENTS, ConfigModel, Float, Int, option, rule_error


class OffloadDevice(str, Enum):
    """Where offloaded state lives. A ``str`` enum, so ``device == "cpu"`` works."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"

    def __str__(self) -> str:
        return self.value


def _require_nvme_path(section: ConfigModel) -> None:
    if section.device == OffloadDevice.nvme and not section.nvme_path:
        raise rule_error(
            "nvme_path", section.nvme_path,
            'is required when device is "nvme": give the directory on the NVMe drive to swap to')


def _nvme_buffers(section: "OffloadOptimizerConfig") -> None:
    # One buffer for the sub-group being stepped, one more for the next one's read
    # (pipeline_read) and one for the previous one's write (pipeline_write): the NVMe store
    # refuses fewer at the first step.
    on = [k for k in ("pipeline_read", "pipeline_write") if getattr(section, k)]
    need = 1 + len(on)
    if section.buffer_count >= need:
        return
    if not on:
        raise rule_error("buffer_count", section.buffer_count,
                         'must be >= 1 when device is "nvme" (optimizer state is swapped through '
                         "these host buffers)")
    raise rule_error("buffer_count", section.buffer_count,
                     f"must be >= {need} with {' and '.join(on)} on (one buffer for the sub-group "
                     "being stepped, one for the next one's read, one for the previous one's "
                     "write); raise buffer_count or turn a pipeline off")


class OffloadParamConfig(ConfigModel):
    """Offload of the (partitioned) 16-bit parameters. ZeRO stage 3 only."""

    device: OffloadDevice = option(
        OffloadDevice.none,
        "Where partitioned parameters live between uses: none (accelerator), cpu or nvme.",
        ds_note='DeepSpeed\'s config docs show "cpu" as the default; its code uses "none".')
    nvme_path: Optional[str] = option(
        None, "Directory on an NVMe drive for parameter swap files (required with nvme). zero_ext: with "
        "an optimizer it needs room for twice the trained pieces, reserved at initialize (a spare file "
        "per sub-group, so that a step whose write fails is undone; docs/nvme.md).",
        ds_note="DeepSpeed's docs show /local_nvme; its code default is null.")
    buffer_count: Int = option(5, "Number of swap buffers for NVMe parameter offload.", ge=0)
    buffer_size: Int = option(
        100_000_000, "Elements per NVMe swap buffer; must hold the largest partition.", ge=0,
        le=MAX_ELEMENTS)
    max_in_cpu: Int = option(
        1_000_000_000, "Parameter elements kept in CPU memory when offloading to NVMe.", ge=0,
        le=MAX_ELEMENTS)
    pin_memory: bool = option(
        True, "Use page-locked host memory (needed for asynchronous, full-bandwidth copies).",
        ds_note="Default changed from false to true in DeepSpeed 0.19.5.")

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> "OffloadParamConfig":
        _require_nvme_path(self)
        if self.device == OffloadDevice.nvme and self.buffer_count < 1:
            raise rule_error("buffer_count", self.buffer_count,
                             'must be >= 1 when device is "nvme" (parameters are swapped through '
                             "these host buffers)")
        return self


class OffloadOptimizerConfig(ConfigModel):
    """Offload of optimizer state (and the optimizer step) to CPU or NVMe."""

    device: OffloadDevice = option(
        OffloadDevice.none,
        "Where optimizer state lives: none (accelerator), cpu or nvme. Any offload runs the "
        "optimizer step on the CPU.",
        ds_note='DeepSpeed\'s config docs show "cpu" as the default; its code uses "none".')
    nvme_path: Optional[str] = option(
        None, "Directory on an NVMe drive for optimizer-state swap files (required with nvme). zero_ext: "
        "it needs room for twice this rank's fp32 masters and optimizer state, reserved at "
        "initialize: each sub-group has a spare file, so that a step whose write fails is undone "
        "(docs/nvme.md).")
    buffer_count: Int = option(
        4, "Number of swap buffers for NVMe optimizer offload; at least the number of states "
        "per parameter (4 for Adam: param, grad, momentum, variance).", ge=0)
    pin_memory: bool = option(
        True, "Use page-locked host memory for offloaded optimizer state.",
        ds_note="Default changed from false to true in DeepSpeed 0.19.5.")
    pipeline_read: bool = option(
        False, "NVMe: overlap reading the next optimizer sub-group with the current step.")
    pipeline_write: bool = option(
        False, "NVMe: overlap writing the previous optimizer sub-group with the current step.")
    fast_init: bool = option(False, "NVMe: faster optimizer-state initialisation.")
    ratio: Float = option(
        1.0, "Fraction of optimizer state offloaded; below 1 the rest is updated on the "
        "accelerator (partial offload, stage 3 only).", ge=0.0, le=1.0)
    super_offload: bool = option(
        False, "SuperOffload: CPU offload tuned for superchips (Grace Hopper); stage 3 only.")
    cpuadam_cores_perc: Float = option(
        0.8, "Fraction of CPU cores the CPU optimizer uses with super_offload.", ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> "OffloadOptimizerConfig":
        _require_nvme_path(self)
        if self.device == OffloadDevice.nvme:
            _nvme_buffers(self)
        return self

    @property
    def pipeline(self) -> bool:
        """True when either NVMe pipelining direction is on (DeepSpeed derives the same)."""
        return self.pipeline_read or self.pipeline_write
