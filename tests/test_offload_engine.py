"""ZeRO-Offload (offload_optimizer / offload_param "cpu"): parity, placement, the optimizer rules.

Parity: each case trains the same model three times in the same processes —
- OFFLOAD: the config asks for AdamW with offload; the engine builds the C optimizer (CPUAdam) and
  steps it fused (unscale + clip + Adam + 16-bit copy-out in one pass) on host masters;
- SAME_KERNEL: no offload, the client passes CPUAdam — the same C arithmetic on the same values, so
  the two must agree bit for bit (losses, parameters, fp32 masters, Adam state, skipped steps);
- TORCH: no offload, torch.optim.AdamW (torch_adam) — the C kernel equals torch's up to torch's own vectorised sqrt
  (1 ulp, see csrc/cpu_adam.c), so fp32 agrees within 1e-5 |p| + 1e-4 lr per element over the run
  (Adam divides by sqrt(v): where v is tiny, as for attention key weights, a 1-ulp difference grows;
  measured at most 9.1e-7 on one element of |p| = 0.035, z2-fp32-n2-gpt) and within 1e-6 relative
  L2 per tensor (measured <= 2.6e-7); 16-bit runs agree within their dtype's bound
  (test_engine_parity.py's argument).
Cases cover stage x dtype x world x accumulation pairwise, plus offload_param and ratio 0.5 at stage 3.
"""
import pytest
import torch

from helpers.engine import fp32_masters, full_params, train, trained
from helpers.harness import run_ranks
from helpers.models import MODELS

STEPS = 6
MICRO = 2
LR = 1e-2

# (stage, dtype, world, gas, model, offload options)
CASES = [
    (1, "fp32", 1, 1, "mlp", {}),
    (1, "bf16", 2, 3, "gpt", {}),
    (1, "fp16", 4, 1, "mlp", {}),
    (2, "fp32", 2, 1, "gpt", {}),
    (2, "bf16", 4, 3, "mlp", {}),
    (2, "fp16", 1, 3, "gpt", {}),
    (3, "fp32", 4, 3, "gpt", {"param": True}),
    (3, "bf16", 1, 1, "gpt", {"param": True}),
    (3, "fp16", 2, 1, "mlp", {"param": True}),
    (3, "fp32", 2, 3, "mlp", {"ratio": 0.5}),
    (3, "bf16", 2, 1, "gpt", {"ratio": 0.5, "param": True}),
]


def _id(case):
    stage, dtype, world, gas, model, opts = case
    return f"z{stage}-{dtype}-n{world}-gas{gas}-{model}" + "".join(f"-{k}={v}" for k, v in opts.items())


def _config(case, offload: bool):
    stage, dtype, world, gas, model, opts = case
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, sub_group_size=60)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": opts.get("ratio", 1.0)}
        if opts.get("param"):
            zero["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": zero}
    if dtype == "fp16":  # a first scale of 2^17 overflows: the first steps are skipped, then it trains
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 17, "loss_scale_window": 2}
    return cfg


def _batches(case):
    stage, dtype, world, gas, model, opts = case
    gen = torch.Generator().manual_seed(4321)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    return [[[MODELS[model].batch(MICRO, gen, dt) for _ in range(world)] for _ in range(gas)] for _ in range(STEPS)]


def _train(case, mode):
    import zero_ext
    from zero_ext.ops.adam import CPUAdam
    from zero_ext.utils import safe_get_full_optimizer_state

    stage, dtype, world, gas, model_name, opts = case
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MODELS[model_name]()
    cfg = _config(case, offload=mode == "offload")
    optimizer = None
    if mode == "same_kernel":
        optimizer = lambda groups: CPUAdam(groups, lr=LR, weight_decay=0.01)  # noqa: E731
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": mode == "torch"}}
    engine, opt, _, _ = zero_ext.initialize(model=model, optimizer=optimizer, config=cfg,
                                            model_parameters=model.parameters())
    if mode == "offload":
        assert type(opt.optimizer).__name__ == "CPUAdam", "offload must build the C optimizer"
    if mode == "torch":
        assert type(opt.optimizer) is torch.optim.AdamW, "torch_adam must keep torch's AdamW"
    losses = train(engine, _batches(case), rank)
    masters = fp32_masters(engine)
    states = {n: (safe_get_full_optimizer_state(p, "exp_avg"), safe_get_full_optimizer_state(p, "exp_avg_sq"))
              for n, p in trained(engine)}
    params = full_params(engine)
    memory = engine.memory_breakdown()
    skipped = engine.skipped_steps
    engine.destroy()
    return losses, params, masters, states, skipped, memory


def _three_runs(case):
    return {mode: _train(case, mode) for mode in ("offload", "same_kernel", "torch")}


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_offload_matches_the_same_kernel_bit_for_bit_and_torch_within_bound(case):
    stage, dtype, world, gas, model, opts = case
    results = run_ranks(world, _three_runs, case, timeout=240)
    for rank, runs in enumerate(results):
        off, same, ref = runs["offload"], runs["same_kernel"], runs["torch"]
        assert off[0] == same[0], f"rank {rank}: losses differ from the same kernel without offload"
        for n in off[1]:
            assert torch.equal(off[1][n], same[1][n]), f"rank {rank}: parameter {n} differs"
        for n in off[2]:
            assert torch.equal(off[2][n], same[2][n]), f"rank {rank}: fp32 master {n} differs"
            assert torch.equal(off[3][n][0], same[3][n][0]) and torch.equal(off[3][n][1], same[3][n][1]), \
                f"rank {rank}: Adam state of {n} differs"
        assert off[4] == same[4] == ref[4]
        if dtype == "fp16":
            assert off[4] >= 1, "the fp16 case must exercise a skipped step"
        rel, absolute = (1e-5, 1e-4 * LR) if dtype == "fp32" else (2 ** -6, 2 * STEPS * LR)
        for n, p in off[1].items():
            excess = ((p - ref[1][n]).abs() - (rel * ref[1][n].abs() + absolute)).max().item()
            assert excess <= 0, f"rank {rank}: {n} differs from torch's AdamW by {excess:.3g} beyond the bound"
            if dtype == "fp32":
                l2 = ((p - ref[1][n]).norm() / ref[1][n].norm().clamp_min(1e-30)).item()
                assert l2 <= 1e-6, f"rank {rank}: {n} differs from torch's AdamW by {l2:.3g} relative L2"

        # placement: the offloaded optimizer holds nothing on the accelerator
        acc = {kind: tiers["accelerator"] for kind, tiers in off[5].items()}
        host = {kind: tiers["host"] for kind, tiers in off[5].items()}
        if opts.get("ratio", 1.0) == 1.0:
            assert acc["optimizer_state"] == acc["fp32_master"] == acc["fp32_grads"] == 0, off[5]
            assert host["optimizer_state"] > 0 and host["fp32_master"] > 0
        else:  # part on each side
            assert acc["optimizer_state"] > 0 and host["optimizer_state"] > 0, off[5]
        if opts.get("param"):
            assert host["params"] > 0
        # without offload everything is on the accelerator tier
        assert all(tiers["host"] == 0 for tiers in same[5].values()), same[5]


def _ratio_run(ratio):
    import zero_ext

    torch.manual_seed(0)
    model = MODELS["gpt"]()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
           "zero_optimization": {"stage": 3, "sub_group_size": 150, "stage3_param_persistence_threshold": 0,
                                 "offload_optimizer": {"device": "cpu", "ratio": ratio}}}
    engine, opt, _, _ = zero_ext.initialize(model=model, config=cfg, model_parameters=model.parameters())
    on_host = [g.offloaded for g in opt.flat_groups]
    gen = torch.Generator().manual_seed(1)
    rank = torch.distributed.get_rank()
    for _ in range(4):
        batches = [MODELS["gpt"].batch(2, gen) for _ in range(2)]
        engine.backward(engine.module.loss(batches[rank]))
        engine.step()
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return on_host, params


def _ratio_runs():
    return _ratio_run(1.0), _ratio_run(0.5)


def test_ratio_splits_sub_groups_and_equals_full_offload_bit_for_bit():
    full, half = run_ranks(2, _ratio_runs)[0]
    assert all(full[0]) and len(full[0]) > 2
    assert any(half[0]) and not all(half[0]), half[0]
    assert half[0] == sorted(half[0], reverse=True), "host sub-groups are the leading ones"
    for a, b in zip(full[1], half[1]):
        assert torch.equal(a, b)


def test_host_subgroups_takes_the_leading_share():
    from zero_ext.config import load_config
    from zero_ext.offload.plan import OffloadPlan

    def plan(ratio):
        cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}}})
        return OffloadPlan(cfg.zero_optimization)

    assert plan(1.0).host_subgroups([5, 5, 5]) == [True, True, True]
    assert plan(0.5).host_subgroups([5, 5, 5, 5]) == [True, True, False, False]
    assert plan(0.3).host_subgroups([10, 1, 1]) == [True, False, False]  # at least one
    assert plan(0.0).host_subgroups([5, 5]) == [False, False]


@pytest.mark.parametrize("name", ["adam", "adamw", "adam_l2", "adagrad", "lion"])
def test_device_math_equals_the_c_kernel(name):
    """The torch-operation update used for sub-groups kept on the accelerator (ratio < 1), run here on
    CPU tensors against the C kernel: the same formula; torch's vectorised sqrt may round 1 ulp off."""
    from zero_ext.ops import device_math
    from zero_ext.ops.adagrad import CPUAdagrad
    from zero_ext.ops.adam import CPUAdam
    from zero_ext.ops.lion import CPULion

    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(1003, generator=gen)
    grads = [torch.randn(1003, generator=gen) for _ in range(5)]
    p = p0.clone().requires_grad_(True)
    opt = {"adam": lambda: CPUAdam([p], lr=1e-2, weight_decay=0.1, adamw_mode=True),
           "adamw": lambda: CPUAdam([p], lr=1e-2, weight_decay=0.0),
           "adam_l2": lambda: CPUAdam([p], lr=1e-2, weight_decay=0.1, adamw_mode=False),
           "adagrad": lambda: CPUAdagrad([p], lr=1e-2, weight_decay=0.1),
           "lion": lambda: CPULion([p], lr=1e-3, weight_decay=0.1)}[name]()
    q = p0.clone()
    state = {k: torch.zeros_like(q) for k in ("m", "v")}
    group = opt.param_groups[0]
    for step, g in enumerate(grads, 1):
        p.grad = g.clone()
        opt.step(grad_scale=0.5)
        if name.startswith("adam"):
            b1, b2 = group["betas"]
            device_math.adam_(q, g, state["m"], state["v"], lr=1e-2, beta1=b1, beta2=b2, eps=group["eps"],
                              weight_decay=group["weight_decay"], step=step, bias_correction=True,
                              adamw_mode=opt.adam_w_mode, grad_scale=0.5)
        elif name == "adagrad":
            device_math.adagrad_(q, g, state["v"], lr=1e-2, eps=group["eps"], weight_decay=0.1, grad_scale=0.5)
        else:
            b1, b2 = group["betas"]
            device_math.lion_(q, g, state["m"], lr=1e-3, beta1=b1, beta2=b2, weight_decay=0.1, grad_scale=0.5)
    err = ((p.detach() - q).abs() / (q.abs() + 1e-2)).max().item()
    assert err <= 1e-6, f"{name}: max |dp| / (|p| + lr) = {err:.3g}"


def _client_optimizer(force):
    import zero_ext
    from zero_ext.config import ConfigError

    torch.manual_seed(0)
    model = MODELS["mlp"]()
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": force,
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    try:
        engine, _, _, _ = zero_ext.initialize(model=model, optimizer=opt, config=cfg)
    except ConfigError as exc:
        return str(exc)
    gen = torch.Generator().manual_seed(2)
    engine.backward(engine.module.loss(MODELS["mlp"].batch(2, gen)))
    engine.step()
    table = engine.memory_breakdown()
    engine.destroy()
    return table


def _client_optimizers():
    return _client_optimizer(True), _client_optimizer(False)


def test_client_optimizer_with_offload_follows_zero_force_ds_cpu_optimizer():
    message, table = run_ranks(1, _client_optimizers)[0]
    assert "zero_force_ds_cpu_optimizer" in message and "AdamW" in message and "CPUAdam" in message
    assert table["optimizer_state"]["accelerator"] == 0 and table["optimizer_state"]["host"] > 0
