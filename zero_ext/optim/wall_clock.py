"""``wall_clock_breakdown``: how long each phase of a training step takes, by DeepSpeed's timer names.

Phases (milliseconds of host wall time; with CUDA the device is synchronised at each edge so the time is
the work's, not the launch's):

- ``fwd``: engine.forward; ``bwd``: engine.backward, of which ``bwd_inner`` is the autograd pass (at
  stages 2/3 it includes the gradient reduction the backward hooks start);
- ``bwd_allreduce``: the reducer's own reduction work: at stages 0/1 the reduction of the accumulated
  gradients, which zero_ext runs at the start of the boundary step (so it is inside ``step``), at stages
  2/3 the end-of-backward flush of the last buckets (inside ``bwd_inner``);
- ``step``: engine.step.

Each phase has a ``<name>_microstep`` timer (the last micro step) and a global one (the sum since the
last report). At each optimizer step where steps_per_print says so (every step when it is unset) rank 0
prints DeepSpeed's two lines, ``time (ms) | fwd_microstep: ... `` and ``time (ms) | fwd: ...`` (the
global ones as means per optimizer step since the last report), and the global timers restart.
``snapshot()`` (engine.get_wall_clock_timers()) holds every timer's value after each step() call.
"""
import contextlib
import functools
import time
from typing import Callable, Dict, Optional

import torch

PHASES = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")


class WallClock:
    """Per-phase wall-clock totals of one engine; ``enabled`` False makes every call a no-op."""

    def __init__(self, enabled: bool, steps_per_print: Optional[int] = None, rank: int = 0,
                 printer: Callable[[str], None] = print):
        self.enabled, self.every, self.rank, self.printer = enabled, steps_per_print, rank, printer
        self.micro: Dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.total: Dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.steps_since_report = 0
        self._cache: Dict[str, float] = {}
        self._open: Dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        """Times the block under ``name`` (a re-entered phase counts once, from its outer start)."""
        if not self.enabled or name in self._open:
            yield
            return
        _sync()
        self._open[name] = time.perf_counter()
        try:
            yield
        finally:
            _sync()
            ms = (time.perf_counter() - self._open.pop(name)) * 1000.0
            self.micro[name] += ms
            self.total[name] += ms

    def timed(self, name: str, fn: Callable) -> Callable:
        """``fn`` timed under ``name`` (for the reducer's methods, wrapped by the builder)."""
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        return run

    def end_micro_step(self, boundary: bool, global_steps: int) -> None:
        """After each engine.step(): refresh the snapshot; at a reporting boundary print and restart."""
        if not self.enabled:
            return
        self._cache = {**{f"{k}_microstep": v for k, v in self.micro.items()}, **self.total}
        report = boundary and (self.every is None or global_steps % self.every == 0)
        if boundary:
            self.steps_since_report += 1
        if report and self.rank == 0:
            self.printer(_line({f"{k}_microstep": v for k, v in self.micro.items()}))
            self.printer(_line({k: v / self.steps_since_report for k, v in self.total.items()}))
        if report:
            self.total = dict.fromkeys(PHASES, 0.0)
            self.steps_since_report = 0
        self.micro = dict.fromkeys(PHASES, 0.0)

    def snapshot(self) -> Dict[str, float]:
        """Timer name -> milliseconds, as of the last step() (empty when disabled or before one)."""
        return dict(self._cache)


def _line(values: Dict[str, float]) -> str:
    return "time (ms)" + "".join(f" | {k}: {v:.2f}" for k, v in values.items())


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
