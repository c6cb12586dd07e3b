"""``engine.tput_timer``: DeepSpeed's throughput timer (samples per second of training), its fields and
their meaning as DeepSpeed's own tests and libraries read them.

The engine starts it at each forward and stops it at each step() (``global_step`` True at an
accumulation boundary). The first ``start_step`` optimizer steps (2: warm-up, compilation, allocator
growth) are not timed: ``start()`` records a start time only once ``global_step_count`` reached
``start_step``, and ``stop()`` adds the elapsed time only when there is one. ``batch_size`` is the
engine's train_batch_size (micro batch x accumulation steps x data-parallel ranks), so
``avg_samples_per_sec()`` is the whole job's rate. At a boundary whose step count is a multiple of
``steps_per_output`` (the config's steps_per_print; unset: never) and with ``report_speed``, one line goes
to the ``zero_ext`` logger at INFO. The config section ``timers.throughput`` (``enabled``, default
true; ``synchronized``, default true: wait for the device at each edge) switches it.
"""
import logging
import time
from typing import Callable, Optional

import torch

_EPSILON = 1e-6  # (a step of zero measured time still gives a finite rate)


class ThroughputTimer:
    def __init__(self, batch_size: Optional[int], start_step: int = 2, steps_per_output: Optional[int] = None,
                 enabled: bool = True, synchronized: bool = True, logging_fn: Optional[Callable[[str], None]] = None):
        self.enabled, self.synchronized = enabled, synchronized
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step, self.steps_per_output = start_step, steps_per_output
        self.start_time = self.end_time = 0.0
        self.started = self.initialized = False
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = self.step_elapsed_time = 0.0
        self.logging = logging_fn if logging_fn is not None else logging.getLogger("zero_ext").info

    @classmethod
    def for_engine(cls, config) -> "ThroughputTimer":
        """The engine's timer: its train_batch_size and steps_per_print, the ``timers.throughput`` section."""
        section = (config.ignored_sections.get("timers") or {}).get("throughput") or {}
        return cls(config.train_batch_size, steps_per_output=config.steps_per_print,
                   enabled=bool(section.get("enabled", True)), synchronized=bool(section.get("synchronized", True)))

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.enabled:
            return
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self._sync()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return
        self._sync()
        self.end_time = time.time()
        elapsed = self.end_time - self.start_time
        self.total_elapsed_time += elapsed
        self.step_elapsed_time += elapsed
        if not global_step:
            return
        if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
            self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                         f"global_step={self.global_step_count}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                         f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + _EPSILON)}")
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps (-inf before any step)."""
        timed = self.global_step_count - self.start_step
        if self.global_step_count <= 0 or timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)

    def _sync(self) -> None:
        if self.synchronized and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


__all__ = ["ThroughputTimer"]
