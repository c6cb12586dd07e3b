"""Learning-rate schedulers with DeepSpeed's names, parameters, defaults and formulas.

    WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest   (DeepSpeed's five)
    build_scheduler(sched_cfg, optimizer, total_num_steps=None)      (config -> scheduler)
    configure_lr_scheduler(client, sched_cfg, optimizer, ...)        (initialize's precedence)

Each scheduler writes ``lr`` (OneCycle also ``betas``) into ``optimizer.param_groups``, one value
per group; ``optimizer`` is anything with ``param_groups`` (a torch optimizer, the engine's
ZeroOptimizer wrapper, a stand-in). ``step()`` is meant to be called once per *applied*
optimizer step. ``state_dict()`` is DeepSpeed's: ``{"last_batch_iteration": n}``.
docs/schedulers.md gives every formula.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
           "DEEPSPEED_SCHEDULER_CLASSES", "build_scheduler", "configure_lr_scheduler"]

LOG, LINEAR = "log", "linear"
#: beta2 that OneCycle writes with the cycled beta1 (DeepSpeed's constant).
ONE_CYCLE_BETA2 = 0.99


def _param_groups(optimizer: Any) -> List[Dict[str, Any]]:
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        raise TypeError(f"{type(optimizer).__name__} has no param_groups; a scheduler needs an "
                        "optimizer (or an object with param_groups)")
    return groups


def _per_group(groups: Sequence[Any], value: Any, name: str) -> List[Any]:
    """A scalar for every group, or a list/tuple with one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f"expected {len(groups)} values for {name} (one per parameter "
                             f"group), got {len(value)}")
        return list(value)
    return [value] * len(groups)


def _as_float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)


def _write_lr(groups: Sequence[Dict[str, Any]], lrs: Sequence[float]) -> List[float]:
    """Set each group's lr (in place when it is a tensor, as torch's capturable optimizers need)."""
    for group, lr in zip(groups, lrs):
        if hasattr(group.get("lr"), "fill_"):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return list(lrs)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _warmup_curve(warmup_type: str) -> str:
    if warmup_type not in (LOG, LINEAR):
        warnings.warn(f"unknown warmup_type {warmup_type!r}; using 'log' (as DeepSpeed does)",
                      UserWarning, stacklevel=3)
        return LOG
    return warmup_type


class _Scheduler:
    """Shared bookkeeping: the batch counter, lr writes, state_dict."""

    optimizer: Any
    last_batch_iteration: int
    _last_lr: Optional[List[float]] = None

    def get_lr(self) -> List[float]:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _apply(self) -> None:
        self._last_lr = _write_lr(_param_groups(self.optimizer), self.get_lr())

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance one batch (or jump to ``last_batch_iteration``) and write the new lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def get_last_lr(self) -> List[float]:
        """The lr of each group as last written by this scheduler."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): call step() first")
        return list(self._last_lr)

    def state_dict(self) -> Dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


def _warmup_gamma(i: int, num_steps: int, inverse_log: float, warmup_type: str) -> float:
    """Warm-up fraction at batch i < num_steps: log(i+1)/log(N) or i/N."""
    if warmup_type == LOG:
        return inverse_log * math.log(i + 1)
    return i / num_steps


class WarmupLR(_Scheduler):
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps, then stays there.
    warmup_max_lr=None takes each group's current lr."""

    def __init__(self, optimizer: Any, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = LOG,
                 last_batch_iteration: int = -1):
        _positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = optimizer
        groups = _param_groups(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [_as_float(g["lr"]) for g in groups]
        self.min_lrs = _per_group(groups, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(groups, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)  # log(1) would divide by zero
        self.warmup_type = _warmup_curve(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._apply()  # writes warmup_min_lr

    def _get_gamma(self) -> float:
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            return _warmup_gamma(i, self.warmup_num_steps, self.inverse_log_warm_up,
                                 self.warmup_type)
        return 1.0

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from warmup_max_lr back to warmup_min_lr at total_num_steps.
    Note warmup_max_lr defaults to 0.001 here, not to the optimizer's lr."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = LOG, last_batch_iteration: int = -1):
        if total_num_steps is None:
            raise ValueError("WarmupDecayLR needs total_num_steps")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupDecayLR: total_num_steps {total_num_steps} is less than "
                          f"warmup_num_steps {warmup_num_steps}", UserWarning, stacklevel=2)

    def _get_gamma(self) -> float:
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            return _warmup_gamma(i, self.warmup_num_steps, self.inverse_log_warm_up,
                                 self.warmup_type)
        return max(0.0, float(self.total_num_steps - i)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Scheduler):
    """Ratio of each group's lr (taken at construction): rises from warmup_min_ratio to 1 over
    warmup_num_steps, then follows a cosine down to cos_min_ratio at total_num_steps."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = LOG, last_batch_iteration: int = -1):
        _positive_int(warmup_num_steps, "warmup_num_steps")
        if total_num_steps is None:
            raise ValueError("WarmupCosineLR needs total_num_steps")
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_curve(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupCosineLR: total_num_steps {total_num_steps} is less than "
                          f"warmup_num_steps {warmup_num_steps}", UserWarning, stacklevel=2)
        self.org_lrs = [_as_float(g["lr"]) for g in _param_groups(optimizer)]
        if last_batch_iteration == -1:
            self._apply()  # writes 0.0 (DeepSpeed's value before the first step)

    def get_lr_ratio(self) -> float:
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            ratio = _warmup_gamma(i, self.warmup_num_steps, self.inverse_log_warm_up,
                                  self.warmup_type)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = i - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(_Scheduler):
    """lr = lr_range_test_min_lr * (1 + step_rate * (i+1)/step_size), floored when staircase."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: Any = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        groups = _param_groups(optimizer)
        self.min_lr = _per_group(groups, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _write_lr(groups, self.min_lr)

    def _interval(self) -> float:
        x = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(x) if self.staircase else x

    def get_lr(self) -> List[float]:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]

    def step(self, batch_iteration: Optional[int] = None, *,
             last_batch_iteration: Optional[int] = None) -> None:
        """DeepSpeed names the argument ``batch_iteration`` here; both names are accepted."""
        super().step(batch_iteration if batch_iteration is not None else last_batch_iteration)


def _has_betas(optimizer: Any, groups: Sequence[Dict[str, Any]]) -> bool:
    defaults = getattr(optimizer, "defaults", None)
    if isinstance(defaults, dict):
        return "betas" in defaults
    return bool(groups) and all("betas" in g for g in groups)


class OneCycle(_Scheduler):
    """1-cycle: lr rises cycle_min_lr -> cycle_max_lr over cycle_first_step_size batches, falls
    back over cycle_second_step_size, then decays (lr / (1 + rate * t/decay_step_size));
    beta1 moves inversely between cycle_max_mom and cycle_min_mom."""

    def __init__(self, optimizer: Any, cycle_min_lr: Any, cycle_max_lr: Any,
                 decay_lr_rate: float = 0., cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: Any = 0.8,
                 cycle_max_mom: Any = 0.9, decay_mom_rate: float = 0.,
                 last_batch_iteration: int = -1):
        self.optimizer = optimizer
        groups = _param_groups(optimizer)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError("cycle_second_step_size must be non-negative, got "
                             f"{cycle_second_step_size}")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)

        self.min_lrs = _per_group(groups, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(groups, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        if last_batch_iteration == -1:
            self._last_lr = _write_lr(groups, self.min_lrs)

        self.cycle_momentum = bool(cycle_momentum)
        self.skip_mom_decay = True
        if self.cycle_momentum and not _has_betas(optimizer, groups):
            warnings.warn(f"OneCycle: cycle_momentum is off because {type(optimizer).__name__} "
                          "has no 'betas' (as DeepSpeed does)", UserWarning, stacklevel=2)
            self.cycle_momentum = False
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_moms = [(m, ONE_CYCLE_BETA2)
                             for m in _per_group(groups, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, ONE_CYCLE_BETA2)
                             for m in _per_group(groups, cycle_max_mom, "cycle_max_mom")]
            self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
            if last_batch_iteration == -1:
                for group, betas in zip(groups, self.min_moms):
                    group["betas"] = betas
        self.last_batch_iteration = last_batch_iteration

    def _get_scale_factor(self) -> float:
        b = self.last_batch_iteration + 1
        cycle = math.floor(1 + b / self.total_size)
        x = 1. + b / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # quantised from the integer position, not from the float scale
            pos = b % self.total_size
            if pos <= self.first_step_size:
                stair = pos * stairs / self.first_step_size
            else:
                stair = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def get_lr(self) -> List[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        t = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * (t / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> Optional[List[tuple]]:
        """(beta1, beta2) per group, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                    for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        t = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * (t / self.decay_step_size)
        return [(b1 * factor, b2) for b1, b2 in self.max_moms]

    def step(self, batch_iteration: Optional[int] = None, *,
             last_batch_iteration: Optional[int] = None) -> None:
        """DeepSpeed names the argument ``batch_iteration`` here; both names are accepted."""
        super().step(batch_iteration if batch_iteration is not None else last_batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(_param_groups(self.optimizer), self.get_mom()):
                group["betas"] = betas


#: DeepSpeed's scheduler names and our classes.
DEEPSPEED_SCHEDULER_CLASSES: Dict[str, type] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle, "LRRangeTest": LRRangeTest,
}


def _torch_optimizer(optimizer: Any) -> Any:
    """torch's schedulers check isinstance(Optimizer): unwrap a wrapper's ``.optimizer``."""
    import torch
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _torch_scheduler_class(name: str) -> Optional[type]:
    import torch.optim.lr_scheduler as torch_sched
    cls = getattr(torch_sched, name, None) if not name.startswith("_") else None
    return cls if isinstance(cls, type) and hasattr(cls, "step") else None


def build_scheduler(sched_cfg: Any, optimizer: Any, total_num_steps: Optional[int] = None) -> Any:
    """The scheduler a config's ``scheduler`` section describes (None when there is none).

    ``sched_cfg``: a :class:`zero_ext.config.SchedulerConfig` (``cfg.scheduler``) or a dict
    ``{"type": ..., "params": {...}}``. DeepSpeed's five names build our classes on
    ``optimizer``; any other name must be a ``torch.optim.lr_scheduler`` class, built on the
    underlying torch optimizer with ``params`` as keyword arguments. ``total_num_steps`` fills
    in WarmupDecayLR's / WarmupCosineLR's ``total_num_steps`` when the config left it out or
    gave "auto"; a value in the config wins.
    """
    if sched_cfg is None:
        return None
    if isinstance(sched_cfg, dict):
        name, params = sched_cfg.get("type"), sched_cfg.get("params") or {}
    else:
        name, params = sched_cfg.type, sched_cfg.params or {}
    params = dict(params)
    cls = DEEPSPEED_SCHEDULER_CLASSES.get(name)
    if cls is None:
        torch_cls = _torch_scheduler_class(name) if isinstance(name, str) else None
        if torch_cls is None:
            raise ValueError(f"scheduler.type: unknown scheduler {name!r}; expected one of "
                             f"{', '.join(DEEPSPEED_SCHEDULER_CLASSES)} or a "
                             "torch.optim.lr_scheduler class name")
        return torch_cls(_torch_optimizer(optimizer), **params)
    signature = inspect.signature(cls.__init__)
    if "total_num_steps" in signature.parameters and params.get("total_num_steps") is None:
        if total_num_steps is None:
            raise ValueError(f"scheduler.params.total_num_steps is required by {name} (it is "
                             "missing or \"auto\", and no total_num_steps was passed in)")
        params["total_num_steps"] = total_num_steps
    unknown = [k for k in params if k not in signature.parameters or k == "optimizer"]
    if unknown:
        raise ValueError(f"scheduler.params: {name} has no parameter(s) {', '.join(unknown)}")
    missing = [p.name for p in list(signature.parameters.values())[2:]
               if p.default is inspect.Parameter.empty and p.name not in params]
    if missing:
        raise ValueError(f"scheduler.params: {', '.join(missing)} required by {name} (missing "
                         "or \"auto\")")
    return cls(optimizer, **params)


def configure_lr_scheduler(client_lr_scheduler: Any, sched_cfg: Any, optimizer: Any,
                           basic_optimizer: Any = None,
                           total_num_steps: Optional[int] = None) -> Any:
    """initialize's choice, as DeepSpeed makes it: a client scheduler object wins; a client
    callable is called with the basic (torch) optimizer; otherwise the config's section is
    built on ``optimizer`` (None when the config has no scheduler)."""
    if client_lr_scheduler is not None:
        if callable(client_lr_scheduler) and not hasattr(client_lr_scheduler, "step"):
            target = basic_optimizer if basic_optimizer is not None else _torch_optimizer(optimizer)
            return client_lr_scheduler(target)
        stepped = getattr(client_lr_scheduler, "optimizer", None)
        if stepped is not None and all(stepped is not o for o in (basic_optimizer, optimizer,
                                                                  _torch_optimizer(optimizer))):
            # DeepSpeed takes it (its check looks only for an uninstantiated client optimizer): so do we, aloud
            warnings.warn(
                f"zero_ext.initialize: the lr_scheduler object schedules another optimizer "
                f"({type(stepped).__name__}) than the one the engine steps, so the learning rates it sets never "
                "reach training; build it over the optimizer you pass to initialize, or pass a callable taking "
                "the optimizer (lr_scheduler=lambda opt: ...)", UserWarning, stacklevel=3)
        return client_lr_scheduler
    return build_scheduler(sched_cfg, optimizer, total_num_steps)
