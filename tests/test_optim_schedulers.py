"""zero_ext.optim.schedulers: each DeepSpeed scheduler against its formula (written out here, apart
from the implementation) over a run, resume from state_dict, per-group values, non-torch
optimizers, and build_scheduler from a loaded config."""

import math
import warnings

import pytest
import torch

from zero_ext.config import ConfigError, load_config
from zero_ext.optim.schedulers import (LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR,
                                 build_scheduler, configure_lr_scheduler)

STEPS = 150


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)


def adam(lrs=(0.1, 0.02)):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in lrs]
    return torch.optim.Adam([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)])


class StandIn:
    """Only param_groups: no defaults, not a torch Optimizer."""

    def __init__(self, lrs=(0.1, 0.02), betas=True):
        self.param_groups = [dict(lr=lr, **({"betas": (0.9, 0.999)} if betas else {}))
                             for lr in lrs]


class Wrapper:
    """Like the engine's ZeroOptimizer: param_groups and defaults are the base optimizer's."""

    def __init__(self, base):
        self.optimizer = base

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def defaults(self):
        return self.optimizer.defaults


def lrs_of(opt):
    return [float(g["lr"]) for g in opt.param_groups]


def check_run(opt, sched, expected, steps=STEPS, betas=None):
    """expected(i, group) is the lr after the step that sets last_batch_iteration = i."""
    for i in range(steps):
        sched.step()
        for g, lr in enumerate(lrs_of(opt)):
            assert close(lr, expected(i, g)), (i, g, lr, expected(i, g))
        assert sched.get_last_lr() == lrs_of(opt)
        if betas is not None:
            for g, group in enumerate(opt.param_groups):
                b1, b2 = group["betas"]
                assert close(b1, betas(i, g)) and b2 == 0.99, (i, g, group["betas"])
    assert sched.state_dict() == {"last_batch_iteration": steps - 1}


# ---- the formulas, written out independently -------------------------------------------------

def warm_fraction(i, n, kind):
    n = max(n, 2)
    return math.log(i + 1) / math.log(n) if kind == "log" else i / n


def warmup_lr(i, lo, hi, n, kind):
    frac = warm_fraction(i, n, kind) if i < max(n, 2) else 1.0
    return lo + (hi - lo) * frac


def warmup_decay_lr(i, lo, hi, n, total, kind):
    if i < max(n, 2):
        return warmup_lr(i, lo, hi, n, kind)
    return lo + (hi - lo) * max(0.0, (total - i) / max(1, total - max(n, 2)))


def warmup_cosine_lr(i, base, n, total, min_ratio, cos_min, kind):
    n = max(n, 2)
    if i < n:
        return base * (min_ratio + (1 - min_ratio) * warm_fraction(i, n, kind))
    progress = min(1.0, (i - n + 1) / max(1, total - n))
    return base * (cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))


def one_cycle_fraction(i, up, down, up_stairs, down_stairs):
    """Position in the cycle, 0 at the bottom and 1 at the peak, after batch i (< up+down)."""
    at = (i + 1) % (up + down)
    if at <= up:
        frac, stairs = at / up, up_stairs
    else:
        frac, stairs = (up + down - at) / down, down_stairs
    return math.floor(frac * stairs + 1e-9) / stairs if stairs else frac


def range_test_lr(i, lo, size, rate, staircase):
    x = (i + 1) / size
    return lo * (1 + rate * (math.floor(x) if staircase else x))


# ---- WarmupLR, WarmupDecayLR, WarmupCosineLR -------------------------------------------------

@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    opt = adam()
    lo, hi = [1e-4, 0.0], [0.05, 0.2]
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=60,
                     warmup_type=kind)
    assert lrs_of(opt) == lo and sched.get_last_lr() == lo  # construction writes warmup_min_lr
    check_run(opt, sched, lambda i, g: warmup_lr(i, lo[g], hi[g], 60, kind))
    assert lrs_of(opt) == hi


def test_warmup_lr_defaults_to_optimizer_lr_and_clamps_steps():
    opt = adam((0.3, 0.07))
    sched = WarmupLR(opt, warmup_num_steps=1)  # max(2, 1) steps, log curve
    assert lrs_of(opt) == [0.0, 0.0]
    check_run(opt, sched, lambda i, g: warmup_lr(i, 0.0, (0.3, 0.07)[g], 2, "log"), steps=5)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    opt = adam()
    sched = WarmupDecayLR(opt, total_num_steps=120, warmup_min_lr=1e-5, warmup_num_steps=30,
                          warmup_type=kind)  # warmup_max_lr: 0.001, not the optimizer's lr
    assert lrs_of(opt) == [1e-5, 1e-5]
    check_run(opt, sched, lambda i, g: warmup_decay_lr(i, 1e-5, 1e-3, 30, 120, kind))
    assert lrs_of(opt) == [1e-5, 1e-5]  # past total_num_steps: back at warmup_min_lr, not 0


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    opt = adam((0.1, 0.02))
    sched = WarmupCosineLR(opt, total_num_steps=120, warmup_min_ratio=0.1, warmup_num_steps=20,
                           cos_min_ratio=0.01, warmup_type=kind)
    assert lrs_of(opt) == [0.0, 0.0]  # DeepSpeed writes 0, not warmup_min_ratio * lr
    base = (0.1, 0.02)
    check_run(opt, sched, lambda i, g: warmup_cosine_lr(i, base[g], 20, 120, 0.1, 0.01, kind))
    assert all(close(lr, b * 0.01) for lr, b in zip(lrs_of(opt), base))


# ---- OneCycle --------------------------------------------------------------------------------

def test_one_cycle_smooth_with_decay_and_momentum():
    opt = adam()
    lo, hi, up, down = [1e-3, 2e-4], [0.1, 0.05], 30, 20
    sched = OneCycle(opt, cycle_min_lr=lo, cycle_max_lr=hi, decay_lr_rate=0.5,
                     cycle_first_step_size=up, cycle_second_step_size=down, decay_step_size=10,
                     cycle_min_mom=[0.85, 0.8], cycle_max_mom=0.95, decay_mom_rate=0.01)
    assert lrs_of(opt) == lo
    assert [g["betas"] for g in opt.param_groups] == [(0.85, 0.99), (0.8, 0.99)]
    min_mom = (0.85, 0.8)

    def lr(i, g):
        if i < up + down:
            return lo[g] + (hi[g] - lo[g]) * one_cycle_fraction(i, up, down, 0, 0)
        return lo[g] / (1 + 0.5 * (i - up - down + 1) / 10)

    def beta1(i, g):
        if i < up + down:
            return 0.95 - (0.95 - min_mom[g]) * one_cycle_fraction(i, up, down, 0, 0)
        return 0.95 * (1 + 0.01 * (i - up - down + 1) / 10)

    check_run(opt, sched, lr, steps=120, betas=beta1)


def test_one_cycle_staircase_without_decay():
    opt = adam()
    sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=30, cycle_second_step_size=20,
                     cycle_first_stair_count=3, cycle_second_stair_count=4, decay_lr_rate=0.5)
    # decay_step_size=0: no decay (the rate is ignored), lr stays at cycle_min_lr, beta1 at max
    frac = lambda i: one_cycle_fraction(i, 30, 20, 3, 4)  # noqa: E731
    lr = lambda i, g: 0.01 + 0.09 * frac(i) if i < 50 else 0.01  # noqa: E731
    beta1 = lambda i, g: 0.9 - 0.1 * frac(i) if i < 50 else 0.9  # noqa: E731
    check_run(opt, sched, lr, steps=80, betas=beta1)
    assert {round(0.01 + 0.09 * frac(i), 12) for i in range(30)} == {
        0.01, 0.04, 0.07, 0.1}


def test_one_cycle_without_betas_does_not_cycle_momentum():
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    with pytest.warns(UserWarning, match="cycle_momentum is off"):
        sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=10)
    check_run(opt, sched, lambda i, g: 0.01 + 0.09 * one_cycle_fraction(i, 10, 10, 0, 0) if i < 20
              else 0.01, steps=40)
    assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9
    sched = OneCycle(adam(), 0.01, 0.1, cycle_momentum=False)
    assert sched.get_mom() is None


# ---- LRRangeTest -----------------------------------------------------------------------------

@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = adam()
    lo = [1e-3, 5e-4]
    sched = LRRangeTest(opt, lr_range_test_min_lr=lo, lr_range_test_step_size=7,
                        lr_range_test_step_rate=2.5, lr_range_test_staircase=staircase)
    assert lrs_of(opt) == lo
    check_run(opt, sched, lambda i, g: range_test_lr(i, lo[g], 7, 2.5, staircase))


# ---- shared behaviour ------------------------------------------------------------------------

MAKERS = {
    "WarmupLR": lambda o: WarmupLR(o, warmup_min_lr=0.01, warmup_num_steps=40),
    "WarmupDecayLR": lambda o: WarmupDecayLR(o, 100, warmup_num_steps=20, warmup_type="linear"),
    "WarmupCosineLR": lambda o: WarmupCosineLR(o, 100, warmup_num_steps=20),
    "OneCycle": lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=20, decay_step_size=5,
                                   decay_lr_rate=0.2, decay_mom_rate=0.1),
    "LRRangeTest": lambda o: LRRangeTest(o, lr_range_test_step_size=5),
}


def trajectory(opt, sched, steps):
    out = []
    for _ in range(steps):
        sched.step()
        out.append([(g["lr"], g.get("betas")) for g in opt.param_groups])
    return out


@pytest.mark.parametrize("name", list(MAKERS))
def test_state_dict_resumes_identically(name):
    opt = adam()
    whole = trajectory(opt, MAKERS[name](opt), 90)
    opt = adam()
    first = MAKERS[name](opt)
    part = trajectory(opt, first, 37)
    sd = first.state_dict()
    assert sd == {"last_batch_iteration": 36}
    opt = adam()  # a fresh run, as after a restart
    resumed = MAKERS[name](opt)
    resumed.load_state_dict(sd)
    assert part + trajectory(opt, resumed, 53) == whole


@pytest.mark.parametrize("name", list(MAKERS))
def test_stand_in_and_wrapper_match_torch_optimizer(name):
    opt = adam()
    ref = trajectory(opt, MAKERS[name](opt), 60)
    stand_in = StandIn()
    assert trajectory(stand_in, MAKERS[name](stand_in), 60) == ref
    wrapped = Wrapper(adam())
    assert trajectory(wrapped, MAKERS[name](wrapped), 60) == ref


def test_step_to_a_given_batch_and_both_argument_names():
    a, b = adam(), adam()
    sa, sb = WarmupLR(a, warmup_num_steps=50), WarmupLR(b, warmup_num_steps=50)
    for _ in range(20):
        sa.step()
    sb.step(19)
    assert lrs_of(a) == lrs_of(b)
    for cls in (OneCycle, LRRangeTest):
        args = (0.01, 0.1) if cls is OneCycle else ()
        x, y = adam(), adam()
        cls(x, *args).step(batch_iteration=12)  # DeepSpeed's keyword for these two
        cls(y, *args).step(last_batch_iteration=12)
        assert lrs_of(x) == lrs_of(y)


def test_tensor_lr_is_filled_in_place():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.1))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupCosineLR(opt, total_num_steps=50, warmup_num_steps=10, warmup_type="linear")
    for _ in range(5):
        sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    expected = warmup_cosine_lr(4, 0.1, 10, 50, 0.0, 1e-4, "linear")
    assert math.isclose(float(lr_tensor), expected, rel_tol=1e-7)  # a float32 tensor


def test_bad_arguments():
    with pytest.raises(ValueError, match="expected 2 values for warmup_min_lr"):
        WarmupLR(adam(), warmup_min_lr=[0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="cycle_max_lr"):
        OneCycle(adam(), 0.01, [0.1])
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(adam(), warmup_num_steps=0)
    with pytest.raises(ValueError, match="lr_range_test_step_size"):
        LRRangeTest(adam(), lr_range_test_step_size=0)
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(adam(), 0.01, 0.1, cycle_first_step_size=0)
    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())
    with pytest.warns(UserWarning, match="warmup_type"):
        sched = WarmupLR(adam(), warmup_type="cubic")  # DeepSpeed falls back to log
    assert sched.warmup_type == "log"
    sched = WarmupLR(adam(), last_batch_iteration=10)  # resuming: nothing written yet
    with pytest.raises(RuntimeError, match="step"):
        sched.get_last_lr()


# ---- build_scheduler from a loaded config ----------------------------------------------------

def config(sched_type, **params):
    return load_config({"train_batch_size": 8, "scheduler": {"type": sched_type,
                                                               "params": params}})


BUILD_CASES = {
    "WarmupLR": (dict(warmup_min_lr=0.001, warmup_max_lr=0.05, warmup_num_steps=10),
                 lambda o: WarmupLR(o, 0.001, 0.05, 10)),
    "WarmupDecayLR": (dict(total_num_steps=40, warmup_num_steps=10, warmup_type="linear"),
                      lambda o: WarmupDecayLR(o, 40, warmup_num_steps=10, warmup_type="linear")),
    "WarmupCosineLR": (dict(total_num_steps=40, warmup_num_steps=5, cos_min_ratio=0.1),
                       lambda o: WarmupCosineLR(o, 40, warmup_num_steps=5, cos_min_ratio=0.1)),
    "OneCycle": (dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=8),
                 lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=8)),
    "LRRangeTest": (dict(lr_range_test_step_size=3, lr_range_test_staircase=True),
                    lambda o: LRRangeTest(o, lr_range_test_step_size=3,
                                          lr_range_test_staircase=True)),
}


@pytest.mark.parametrize("name", list(BUILD_CASES))
def test_build_scheduler_from_config(name):
    params, direct = BUILD_CASES[name]
    opt = Wrapper(adam())
    sched = build_scheduler(config(name, **params).scheduler, opt)
    assert type(sched).__name__ == name and sched.optimizer is opt
    ref = adam()
    assert trajectory(opt, sched, 50) == trajectory(ref, direct(ref), 50)


def test_build_torch_scheduler_by_name():
    base = adam((0.1, 0.02))
    sched = build_scheduler(config("StepLR", step_size=3, gamma=0.5).scheduler, Wrapper(base))
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and sched.optimizer is base
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
        for _ in range(7):
            sched.step()
    assert all(close(a, b) for a, b in zip(lrs_of(base), [0.1 * 0.25, 0.02 * 0.25]))


def test_build_unknown_names_and_params():
    with pytest.raises(ValueError, match="'Nope'"):
        build_scheduler({"type": "Nope", "params": {}}, adam())
    with pytest.raises(ConfigError):
        config("Nope")  # the config rejects it first
    with pytest.raises(ValueError, match="warmup_steps"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_steps": 3}}, adam())
    with pytest.raises(ValueError, match="cycle_min_lr, cycle_max_lr required by OneCycle"):
        build_scheduler({"type": "OneCycle"}, adam())
    assert build_scheduler(None, adam()) is None


@pytest.mark.parametrize("name", ["WarmupDecayLR", "WarmupCosineLR"])
def test_total_num_steps_auto_or_passed_in(name):
    with pytest.raises(ConfigError, match="total_num_steps"):
        config(name, warmup_num_steps=5)  # missing outright: a config error
    cfg = config(name, total_num_steps="auto", warmup_num_steps=5)
    with pytest.raises(ValueError, match=f"scheduler.params.total_num_steps is required by {name}"):
        build_scheduler(cfg.scheduler, adam())
    assert build_scheduler(cfg.scheduler, adam(), total_num_steps=77).total_num_steps == 77
    given = config(name, total_num_steps=30, warmup_num_steps=5)
    assert build_scheduler(given.scheduler, adam(), total_num_steps=77).total_num_steps == 30


def test_configure_lr_scheduler_precedence():
    base = adam()
    wrapped = Wrapper(base)
    cfg = config("WarmupLR", warmup_num_steps=5).scheduler
    client = LRRangeTest(base)
    assert configure_lr_scheduler(client, cfg, wrapped) is client
    made = configure_lr_scheduler(lambda o: OneCycle(o, 0.01, 0.1), cfg, wrapped)
    assert isinstance(made, OneCycle) and made.optimizer is base  # the callable gets the base
    assert isinstance(configure_lr_scheduler(None, cfg, wrapped), WarmupLR)
    assert configure_lr_scheduler(None, None, wrapped) is None
