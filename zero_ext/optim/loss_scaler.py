"""Loss scaling for fp16: DeepSpeed's dynamic scaler (with hysteresis) and its static one.

The loss is multiplied by the scale before backward so that small fp16 gradients do not flush to zero;
the optimizer divides it out again. Dynamic scaling, per step (DeepSpeed's rules):
- overflow (inf/nan in any rank's gradients): the step is skipped; if the hysteresis is used up the
  scale halves (never below ``min_scale``; already at the floor is an error), else the hysteresis
  shrinks by one;
- a clean step: with ``consecutive_hysteresis`` the hysteresis refills at once; the scale doubles on
  the clean step that follows every ``scale_window`` clean steps since the last overflow (or the start),
  i.e. on the (window+1)-th, as DeepSpeed does since 0.17 (and, without ``consecutive_hysteresis``, the
  hysteresis refills then).
At ZeRO stage 0 DeepSpeed's fp16 optimizers (FP16_Optimizer, FP16_UnfusedOptimizer) apply their own,
simpler rule, and so does stage 0 here: every overflow halves the scale (no hysteresis) and at
``min_loss_scale`` the step is skipped and the scale stays there (no error).
"""


class LossScaleFloorError(RuntimeError):
    """The scale is at min_loss_scale and still overflows: training cannot go on."""


class StaticLossScaler:
    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self):
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state):
        self.cur_scale = state["cur_scale"]


class DynamicLossScaler(StaticLossScaler):
    dynamic = True

    def __init__(self, init_scale: float = 2.0 ** 16, scale_window: int = 1000, min_scale: float = 1.0,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False, scale_factor: float = 2.0,
                 raise_at_floor: bool = True):
        super().__init__(init_scale)
        self.raise_at_floor = raise_at_floor
        self.scale_window, self.min_scale, self.scale_factor = scale_window, float(min_scale), scale_factor
        self.delayed_shift = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale <= self.min_scale and self.raise_at_floor:
                    raise LossScaleFloorError(
                        f"fp16 gradients overflow at the minimum loss scale ({self.min_scale:g}): the scale "
                        "cannot decrease any further. Lower fp16.min_loss_scale, lower the learning rate, or "
                        "train in bf16.")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1  # clean steps before this one since the overflow
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self):
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter, "cur_hysteresis": self.cur_hysteresis,
                "last_overflow_iter": self.last_overflow_iter}

    def load_state_dict(self, state):
        self.__dict__.update({k: state[k] for k in self.state_dict()})


class LossScaleView:
    """A live, read-only view of a scaler under DeepSpeed's names (``optimizer.loss_scale_config``: its
    LossScaleConfig, which its tests and some training loops read)."""

    def __init__(self, scaler: StaticLossScaler, fp16: bool):
        self._scaler, self.use_grad_scaling = scaler, fp16

    def __getattr__(self, name):
        scaler = self._scaler
        dynamic = scaler.dynamic
        if name == "dynamic_loss_scale":
            return dynamic
        if name == "cur_scale":
            return scaler.cur_scale
        if name == "cur_iter":
            return scaler.cur_iter if dynamic else 0
        if name in ("last_overflow_iter", "scale_factor", "scale_window"):
            return getattr(scaler, name) if dynamic else None
        if name == "min_loss_scale":
            return scaler.min_scale if dynamic else None
        raise AttributeError(f"loss_scale_config has no attribute {name!r}")

    def __repr__(self):
        names = ("use_grad_scaling", "dynamic_loss_scale", "cur_scale", "cur_iter", "scale_window")
        return "LossScaleConfig(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"


def scaler_from_config(fp16, stage: int = 1) -> StaticLossScaler:
    """The scaler an ``fp16`` config section asks for (scale 1 when fp16 is off); ``stage`` 0 takes the
    stage-0 rule (module docstring)."""
    if not fp16.enabled:
        return StaticLossScaler(1.0)
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    stage0 = stage == 0
    return DynamicLossScaler(init_scale=2.0 ** fp16.initial_scale_power, scale_window=fp16.loss_scale_window,
                             min_scale=fp16.min_loss_scale, hysteresis=1 if stage0 else fp16.hysteresis,
                             consecutive_hysteresis=fp16.consecutive_hysteresis, raise_at_floor=not stage0)


def gradscaler_like() -> DynamicLossScaler:
    """fp16 torch_autocast's scaler: torch.amp.GradScaler's defaults, which DeepSpeed uses there (start at
    2**16; an overflow skips the step and halves the scale at once, no hysteresis; every 2000 clean steps
    double it; no floor)."""
    return DynamicLossScaler(init_scale=2.0 ** 16, scale_window=2000, min_scale=0.0, hysteresis=1)
