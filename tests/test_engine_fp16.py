"""fp16 with fp32 master weights and DeepSpeed's loss scaling, against a hand-written reference.

The reference (fp16 model copy, fp32 masters, its own scaler written from DeepSpeed's rules) shares no
code with the engine. Overflows are forced on one rank only (its loss times inf at chosen steps): every
rank must skip the same steps and follow the same scale trajectory as the reference.

Tolerance: fp16's spacing is 2^-10 relative. As for bf16 (see test_engine_parity.py), elements whose
gradient is rounding noise may take opposite Adam steps, so elementwise |dp| <= 2^-9 |p| + 2 STEPS lr,
and over the whole model the relative L2 error stays within 4 spacings, 2^-8.
"""
import math

import pytest
import torch

from helpers.engine import full_params
from helpers.harness import RankFailed, run_ranks
from helpers.models import MLP, MODELS

STEPS = 10
LR = 1e-2
FORCED = {2: 1, 3: 1, 7: 0}  # step -> the one rank whose loss overflows there (modulo the world size)


def _forced(step, rank, world):
    return step in FORCED and FORCED[step] % world == rank
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2}

# pairwise over stage x world x accumulation x model (and consecutive hysteresis)
CASES = [
    (0, 1, 1, "mlp", False), (1, 1, 3, "gpt", True), (2, 1, 1, "gpt", False),
    (0, 2, 3, "gpt", False), (1, 2, 1, "mlp", False), (2, 2, 3, "mlp", True),
    (0, 4, 1, "gpt", True), (1, 4, 3, "mlp", False), (2, 4, 1, "gpt", False),
    (3, 1, 3, "mlp", False), (3, 2, 1, "gpt", True), (3, 4, 3, "mlp", False),
]


def _config(stage, gas, consecutive):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "fp16": {**FP16, "consecutive_hysteresis": consecutive},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 60,
                                  **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}}


def _batches(model, world, gas):
    gen = torch.Generator().manual_seed(7)
    return [[[MODELS[model].batch(2, gen, torch.float16) for _ in range(world)] for _ in range(gas)]
            for _ in range(STEPS)]


def _engine_run(stage, world, gas, model_name, consecutive):
    import zero_ext

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MODELS[model_name]()
    engine, opt, _, _ = zero_ext.initialize(model=model, config=_config(stage, gas, consecutive))
    trajectory = []
    for step, micros in enumerate(_batches(model_name, world, gas)):
        for micro in micros:
            loss = engine.module.loss(micro[rank])
            if _forced(step, rank, world):
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
        trajectory.append((engine.was_step_applied(), opt.cur_scale))
    params = full_params(engine)
    out = {"trajectory": trajectory, "skipped": engine.skipped_steps, "steps": engine.global_steps,
           "params": params}
    engine.destroy()
    return out


class RefScaler:
    """DeepSpeed's dynamic loss scaler, restated for the test (stage 0: its FP16_Optimizer's, without hysteresis)."""

    def __init__(self, consecutive, stage=1):
        self.full = 1 if stage == 0 else FP16["hysteresis"]
        self.scale, self.hyst, self.consecutive = 2.0 ** FP16["initial_scale_power"], self.full, consecutive
        self.it, self.last_overflow = 0, -1

    def update(self, overflow):
        if overflow:
            if self.hyst == 1:
                self.scale /= 2
            else:
                self.hyst -= 1
            self.last_overflow = self.it
        else:
            if self.consecutive:
                self.hyst = self.full
            stable = self.it - self.last_overflow - 1  # (DeepSpeed >= 0.17: doubles on the (window+1)-th clean step)
            if stable > 0 and stable % FP16["loss_scale_window"] == 0:
                self.hyst = self.full
                self.scale *= 2
        self.it += 1


def _reference(stage, world, gas, model_name, consecutive):
    torch.manual_seed(0)
    model = MODELS[model_name]().half()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    lp = dict(model.named_parameters())
    master = {n: lp[n].detach().float().clone() for n in names}
    opt = torch.optim.AdamW([master[n] for n in names], lr=LR, weight_decay=0.01, foreach=False)
    scaler, trajectory = RefScaler(consecutive, stage), []
    for step, micros in enumerate(_batches(model_name, world, gas)):
        grads = {n: torch.zeros_like(master[n]) for n in names}
        for micro in micros:
            for r in range(world):
                model.zero_grad()
                loss = model.loss(micro[r])
                if _forced(step, r, world):
                    loss = loss * float("inf")
                (loss / gas * scaler.scale).backward()
                for n in names:
                    grads[n] += lp[n].grad.float() / world
        norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values())) / scaler.scale
        if not math.isfinite(norm):
            scaler.update(True)
            trajectory.append((False, scaler.scale))
            continue
        combined = (1.0 / scaler.scale) * min(1.0, 1.0 / (norm + 1e-6))
        for n in names:
            master[n].grad = grads[n] * combined
        opt.step()
        with torch.no_grad():
            for n in names:
                lp[n].copy_(master[n])
        scaler.update(False)
        trajectory.append((True, scaler.scale))
    return trajectory, {n: p.detach().float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", CASES, ids=[f"z{c[0]}-n{c[1]}-gas{c[2]}-{c[3]}-consec{c[4]}" for c in CASES])
def test_fp16_matches_the_reference_and_skips_overflows_on_every_rank(case):
    stage, world, gas, model_name, consecutive = case
    results = run_ranks(world, _engine_run, *case, timeout=240)
    ref_trajectory, ref_params = _reference(*case)
    for r, out in enumerate(results):
        assert out["trajectory"] == ref_trajectory, f"rank {r}: skipped steps / loss scale differ"
        assert out["skipped"] == len(FORCED) and out["steps"] == STEPS
    params = results[0]["params"]
    for n, ref in ref_params.items():
        excess = ((params[n] - ref).abs() - (2 ** -9 * ref.abs() + 2 * STEPS * LR)).max().item()
        assert excess <= 0, f"{n}: |dp| exceeds the bound by {excess:.3g}"
    err = math.sqrt(sum((params[n] - ref_params[n]).pow(2).sum().item() for n in params))
    size = math.sqrt(sum(p.pow(2).sum().item() for p in ref_params.values()))
    assert err <= 2 ** -8 * size, f"global relative L2 error {err / size:.5f} > 2^-8"


def test_dynamic_scaler_rules():
    from zero_ext.optim.loss_scaler import DynamicLossScaler, LossScaleFloorError

    s = DynamicLossScaler(init_scale=8, scale_window=2, min_scale=2, hysteresis=2)
    seen = []
    for overflow in [True, True, False, False, False, True, True, True, True]:
        try:
            s.update(overflow)
            seen.append(s.cur_scale)
        except LossScaleFloorError:
            seen.append("floor")
    # the 1st overflow uses up the hysteresis, the 2nd halves; the clean step after 2 clean steps doubles
    # and refills it (DeepSpeed >= 0.17: the (window+1)-th); then 8 -> (hysteresis) 8 -> 4 -> 2 (the floor) -> error
    assert seen == [8, 4, 4, 4, 8, 8, 4, 2, "floor"]


def test_scaler_at_the_floor_raises_deepspeeds_error():
    from zero_ext.optim.loss_scaler import DynamicLossScaler, LossScaleFloorError

    s = DynamicLossScaler(init_scale=2, scale_window=100, min_scale=1, hysteresis=1)
    s.update(True)
    assert s.cur_scale == 1
    with pytest.raises(LossScaleFloorError, match="cannot decrease any further"):
        s.update(True)


def test_stage0_scaler_halves_on_every_overflow_and_stays_at_the_floor():
    from zero_ext.config import load_config
    from zero_ext.optim.loss_scaler import scaler_from_config

    fp16 = load_config({"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 3,
                                                        "hysteresis": 2}}).fp16
    stage0, stage1 = scaler_from_config(fp16, 0), scaler_from_config(fp16, 1)
    seen = []
    for _ in range(5):  # DeepSpeed's stage-0 FP16_Optimizer: no hysteresis, no error at min_loss_scale
        stage0.update(True)
        seen.append(stage0.cur_scale)
    assert seen == [4, 2, 1, 1, 1]
    stage1.update(True)  # ZeRO stages: the hysteresis absorbs the first overflow
    assert stage1.cur_scale == 8


def _static_scale():
    import zero_ext

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale": 128},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    engine, opt, _, _ = zero_ext.initialize(model=MLP(), config=config)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        loss = engine.module.loss(MLP.batch(2, gen, torch.float16))
        engine.backward(loss * (float("inf") if step == 1 else 1.0))
        engine.step()
    return opt.cur_scale, opt.dynamic_loss_scale, engine.skipped_steps, next(engine.module.parameters()).dtype


def test_static_loss_scale_never_changes_but_still_skips_overflows():
    assert run_ranks(1, _static_scale)[0] == (128.0, False, 1, torch.float16)


def _untested_optimizer(allow):
    import zero_ext

    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": allow}
    zero_ext.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    return True


def test_untested_optimizer_needs_the_flag_under_zero():
    with pytest.raises(RankFailed, match="SGD is an untested ZeRO optimizer.*zero_allow_untested_optimizer"):
        run_ranks(1, _untested_optimizer, False)
    assert run_ranks(1, _untested_optimizer, True) == [True]


def _bf16_overflow(check):
    import zero_ext
    from zero_ext.utils import safe_set_full_grad

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "check_grad_overflow": check}}
    engine, *_ = zero_ext.initialize(model=MLP(), config=config)
    x, y = MLP.batch(2, torch.Generator().manual_seed(0), torch.bfloat16)
    engine.backward((engine(x) - y).float().pow(2).mean())
    for p in engine.module.parameters():
        if p.requires_grad:
            safe_set_full_grad(p, torch.full_like(p, float("inf")))
    engine.step()
    finite = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    out = engine.skipped_steps, engine.was_step_applied(), finite
    engine.destroy()
    return out


def test_bf16_check_grad_overflow_false_steps_on_overflowing_gradients():
    assert run_ranks(2, _bf16_overflow, True)[0] == (1, False, True)  # the default: skipped, parameters kept
    assert run_ranks(2, _bf16_overflow, False)[0] == (0, True, False)  # as asked: stepped on, inf/nan now


def _loss_scale_config(fp16):
    import zero_ext

    torch.manual_seed(0)
    precision = ({"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}}
                 if fp16 else {"bf16": {"enabled": True}})
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}}, **precision}
    engine, opt, _, _ = zero_ext.initialize(model=MLP(), config=config)
    view = opt.loss_scale_config  # live: read before the steps
    gen, seen = torch.Generator().manual_seed(0), []
    dtype = torch.float16 if fp16 else torch.bfloat16
    for step in range(4):
        loss = engine.module.loss(MLP.batch(2, gen, dtype))
        engine.backward(loss * (float("inf") if step == 0 else 1.0))
        engine.step()
        seen.append((view.cur_scale, view.cur_iter, view.last_overflow_iter))
    return view.use_grad_scaling, view.dynamic_loss_scale, view.scale_window, view.min_loss_scale, seen


def test_loss_scale_config_is_deepspeeds_view_of_the_scaler():
    fp16 = run_ranks(1, _loss_scale_config, True)[0]
    # the overflow at step 0 halves 256 (hysteresis 1); the scale doubles on the 3rd clean step after it
    assert fp16 == (True, True, 2, 1.0, [(128.0, 1, 0), (128.0, 2, 0), (128.0, 3, 0), (256.0, 4, 0)])
    bf16 = run_ranks(1, _loss_scale_config, False)[0]
    assert bf16[:4] == (False, False, None, None) and bf16[4][-1] == (1.0, 0, None)


def _replaced_unscale(fused: bool):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    cfg = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "initial_scale_power": 4},
           "gradient_clipping": 1e-3, "zero_optimization": {"stage": 0}}
    if fused:  # a config Adam: DeepSpeed's FusedAdam, so FP16_Optimizer's (grad_groups_flat, total_norm) form
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
        engine, *_ = zero_ext.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:  # a torch optimizer: FP16_UnfusedOptimizer's (total_norm) form
        engine, *_ = zero_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    opt, seen = engine.optimizer, []

    def replaced(*args, apply_scale=True):
        seen.append((len(args), float(args[-1]), apply_scale))
        return opt.loss_scaler.cur_scale  # unscale only: no clipping

    opt.unscale_and_clip_grads = replaced
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(3):
        engine.backward(engine.module.loss(MLP.batch(2, gen, torch.float16)))
        engine.step()
        norms.append(engine.get_global_grad_norm() * opt.loss_scaler.cur_scale)
    return seen, norms


@pytest.mark.parametrize("fused", [False, True])
def test_a_replaced_unscale_and_clip_grads_sees_every_steps_norm(fused):
    # (DeepSpeed's tests replace it on the instance to check that every rank clips by one norm)
    seen, norms = run_ranks(1, _replaced_unscale, fused)[0]
    assert [(n, apply) for n, _, apply in seen] == [(2 if fused else 1, False)] * 3
    assert [norm for _, norm, _ in seen] == pytest.approx(norms, rel=1e-6)  # each step's still-scaled norm
