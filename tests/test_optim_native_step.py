"""The config's Adam / AdamW / Adagrad / Lion step CPU tensors on zero_ext's C kernels (optim/factory.py)
without offload too, at every stage; ``torch_adam: true`` keeps torch's.

Which implementation runs is read from the run itself: every optimizer.step() that runs is recorded
(torch's global step hook, which fires for zero_ext's C optimizers as well, since they are
torch.optim.Optimizers) and the C entry points are counted.

Parity: the engine against a single-process plain-PyTorch reference with torch.optim.AdamW / Adam /
Adagrad (Lion: written here from its definition, torch has none), same model, same global batch split
by rank, MLP's two param groups (their own lr and weight decay, a frozen layer, a layer used twice).
Tolerances (../shared/TESTING.md):
- fp32: |dp| <= 1e-5 (|p| + lr), even at one rank: the C kernels agree with torch's Adam(W) and Adagrad
  within 1e-6 (|p| + lr) per step, not bit for bit (torch's vectorised sqrt is not correctly rounded;
  test_ops_cpu_adam.py, test_ops_cpu_adagrad.py), and over STEPS steps that stays within 1e-5.
  Lion has no sqrt: at one rank it is bit-exact.
- bf16 / fp16: the bound of test_engine_parity.py (its argument: parameters stored in the 16-bit type,
  gradients summed in it across ranks, Adam's update not shrinking with noisy gradients):
  |dp| <= 2^-6 |p| + 2 STEPS lr elementwise and ||dtheta|| / ||theta|| <= 2^-5 over the model. fp16's
  spacing (2^-10) is finer than bf16's, so the bf16 argument covers it; its loss scale is static
  (no skipped step, the reference scales the same way).
"""
import collections
import math

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from helpers.engine import full_params, train
from helpers.harness import run_ranks
from helpers.models import MLP

STEPS = 5
MICRO = 2
LR = 1e-2
SCALE = 1024.0  # fp16's static loss scale
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# optimizer kind -> (config section, the C class the engine must build, the C entry point it calls)
KINDS = {
    # (Adam/AdamW without offload: DeepSpeed's class, FusedAdam, whose host kernel is CPUAdam's)
    "adamw": ({"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "FusedAdam", "adam_step"),
    # DeepSpeed's "Adam" with adam_w_mode false: L2 decay added to the gradient (torch.optim.Adam)
    "adam_l2": ({"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01, "adam_w_mode": False}}, "FusedAdam",
                "adam_step"),
    "adagrad": ({"type": "Adagrad", "params": {"lr": LR, "weight_decay": 0.01}}, "CPUAdagrad", "adagrad_step"),
    "lion": ({"type": "Lion", "params": {"lr": LR, "weight_decay": 0.01, "betas": [0.9, 0.99]}}, "CPULion",
             "lion_step"),
}


class _CountingC:
    """Stands in for zero_ext._C in the optimizer modules: counts calls of the *_step kernels, runs them."""

    def __init__(self, real):
        self.real = real
        self.calls = collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if not name.endswith("_step"):
            return fn

        def counted(*args):
            self.calls[name] += 1
            return fn(*args)
        return counted


def _config(stage, dtype, section, gas=1, clip=0.0):
    zero = {"stage": stage, "reduce_bucket_size": 50}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, sub_group_size=100)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "bf16": {"enabled": dtype == "bf16"}, "optimizer": section, "zero_optimization": zero}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": SCALE}
    return cfg


def _batches(world, gas, dtype):
    gen = torch.Generator().manual_seed(777)
    return [[[MLP.batch(MICRO, gen, DTYPES[dtype]) for _ in range(world)] for _ in range(gas)] for _ in range(STEPS)]


def _run(stage, dtype, section, gas=1, clip=0.0):
    """On each rank: train STEPS steps, recording which optimizer classes stepped and the C kernel calls."""
    import zero_ext
    from zero_ext.ops import adagrad, adam, lion

    modules = (adam, adagrad, lion)
    spy = _CountingC(modules[0]._C)
    stepped = collections.Counter()
    hook = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: stepped.update([type(opt).__name__]))
    for m in modules:
        m._C = spy
    try:
        torch.manual_seed(0)
        model = MLP()
        engine, opt, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(),
                                                config=_config(stage, dtype, section, gas, clip))
        base = type(engine.zero_optimizer.optimizer).__name__
        losses = train(engine, _batches(torch.distributed.get_world_size(), gas, dtype),
                       torch.distributed.get_rank())
        params = full_params(engine)
        engine.destroy()
    finally:
        hook.remove()
        for m in modules:
            m._C = spy.real
    return base, dict(stepped), dict(spy.calls), losses, params


# -- which implementation runs ----------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_config_optimizer_steps_cpu_tensors_on_the_c_kernel_without_offload(stage, kind):
    section, cls, kernel = KINDS[kind]
    for base, stepped, calls, _, _ in run_ranks(2, _run, stage, "fp32", section):
        assert base == cls
        assert stepped == {cls: STEPS}, "only the C optimizer may step, once per step"
        # one C call per param group and step (each group's parameters step in one call): MLP has two
        assert calls == {kernel: 2 * STEPS}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torch_adam_keeps_torchs_adamw_and_matches_it_bit_for_bit(stage):
    section = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}}
    ((base, stepped, calls, losses, params),) = run_ranks(1, _run, stage, "fp32", section)
    assert base == "AdamW" and stepped == {"AdamW": STEPS} and not calls
    ref_losses, ref_params = _reference(1, "fp32", "adamw", 1, 0.0)
    assert losses == ref_losses[0]
    for n, p in ref_params.items():  # (the reference's AdamW is torch's too: one rank is exact)
        assert torch.equal(params[n], p), n


@pytest.mark.parametrize("section,cls", [
    ({"type": "Adam", "params": {"lr": LR, "adam_w_mode": False, "torch_adam": True}}, "Adam"),
    # an argument only torch's Adagrad has: torch's Adagrad
    ({"type": "Adagrad", "params": {"lr": LR, "lr_decay": 0.01}}, "Adagrad"),
])
def test_a_section_asking_for_torch_gets_torch(section, cls):
    ((base, stepped, calls, _, _),) = run_ranks(1, _run, 2, "fp32", section)
    assert base == cls and stepped == {cls: STEPS} and not calls


# -- parity against plain PyTorch -------------------------------------------------------------------------

def _lion_step(opt):
    """Lion from its definition, with torch operations: p -= lr sign(lerp(m, g, 1-b1)); m = lerp(m, g, 1-b2)."""
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        for p in group["params"]:
            m = opt.state.setdefault(p, {}).setdefault("exp_avg", torch.zeros_like(p))
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(torch.sign(m.lerp(p.grad, 1 - b1)), alpha=-group["lr"])
            m.lerp_(p.grad, 1 - b2)


def _torch_optimizer(kind, groups):
    params = dict(KINDS[kind][0]["params"])
    if kind == "adamw":
        return torch.optim.AdamW(groups, foreach=False, **params)
    if kind == "adam_l2":
        params.pop("adam_w_mode")
        return torch.optim.Adam(groups, foreach=False, **params)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, foreach=False, **params)
    params["betas"] = tuple(params["betas"])
    return torch.optim.Optimizer(groups, params)  # a holder of groups and state for _lion_step


@torch.no_grad()
def _update(opt, kind):
    if kind == "lion":
        _lion_step(opt)
    else:
        opt.step()


def _reference(world, dtype, kind, gas, clip):
    """fp32 masters over the model in ``dtype`` (for fp32 a separate copy), gradients averaged in fp32."""
    torch.manual_seed(0)
    model = MLP().to(DTYPES[dtype])
    lp = dict(model.named_parameters())
    names = [n for n, p in lp.items() if p.requires_grad]
    master = {n: lp[n].detach().float().clone() for n in names}
    groups = []
    for g in model.param_groups():
        ids = {id(p) for p in g["params"]}
        groups.append({**g, "params": [master[n] for n in names if id(lp[n]) in ids]})
    opt = _torch_optimizer(kind, groups)
    scale = SCALE if dtype == "fp16" else 1.0
    losses = [[] for _ in range(world)]
    for step in _batches(world, gas, dtype):
        grads = {n: torch.zeros_like(master[n]) for n in names}
        for micro in step:
            for r in range(world):
                model.zero_grad()
                loss = model.loss(micro[r])
                (loss * scale / gas).backward() if (world, gas, scale) != (1, 1, 1.0) else loss.backward()
                losses[r].append(loss.float().item())
                for n in names:
                    grads[n] += lp[n].grad.float() / scale / world if (world, scale) != (1, 1.0) else lp[n].grad
        if clip > 0:
            norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))
            if clip / (norm + 1e-6) < 1:
                for g in grads.values():
                    g.mul_(clip / (norm + 1e-6))
        for n in names:
            master[n].grad = grads[n]
        _update(opt, kind)
        with torch.no_grad():
            for n in names:
                lp[n].copy_(master[n])
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}


# (stage, dtype, world, gas, kind, clip): pairwise over stage x dtype x world x optimizer
PARITY = [
    (0, "fp32", 1, 1, "adamw", 0.0),
    (1, "fp32", 2, 2, "adam_l2", 1.0),
    (2, "fp32", 2, 1, "adagrad", 0.0),
    (3, "fp32", 2, 2, "adamw", 0.1),
    (2, "fp32", 1, 2, "lion", 0.0),
    (3, "fp32", 1, 1, "adagrad", 0.0),
    (0, "bf16", 2, 1, "adam_l2", 0.0),
    (1, "bf16", 1, 1, "adagrad", 1.0),
    (2, "bf16", 2, 2, "adamw", 1.0),
    (3, "bf16", 2, 1, "lion", 0.0),
    (0, "fp16", 2, 2, "adagrad", 0.0),
    (1, "fp16", 2, 1, "lion", 0.0),
    (2, "fp16", 1, 1, "adam_l2", 0.0),
    (3, "fp16", 2, 1, "adamw", 0.0),
]


@pytest.mark.parametrize("stage,dtype,world,gas,kind,clip", PARITY,
                         ids=[f"z{s}-{d}-n{w}-gas{g}-{k}-clip{c}" for s, d, w, g, k, c in PARITY])
def test_the_c_kernel_step_matches_torch(stage, dtype, world, gas, kind, clip):
    section, cls, _ = KINDS[kind]
    results = run_ranks(world, _run, stage, dtype, section, gas, clip)
    ref_losses, ref_params = _reference(world, dtype, kind, gas, clip)
    base, stepped, _, _, params = results[0]
    assert base == cls and stepped == {cls: STEPS}
    for _, _, _, _, other in results[1:]:
        assert all(torch.equal(other[n], params[n]) for n in params), "ranks disagree"
    exact = dtype == "fp32" and world == 1 and kind == "lion"
    for n, ref in ref_params.items():
        p = params[n]
        if exact:
            assert torch.equal(p, ref), n
        elif dtype == "fp32":
            excess = ((p - ref).abs() - 1e-5 * (ref.abs() + LR)).max().item()
            assert excess <= 0, f"{n}: {excess:.3g} beyond 1e-5 (|p| + lr)"
        else:
            excess = ((p - ref).abs() - (2 ** -6 * ref.abs() + 2 * STEPS * LR)).max().item()
            assert excess <= 0, f"{n}: {excess:.3g} beyond the {dtype} bound"
    if dtype != "fp32":
        num = math.sqrt(sum((params[n] - r).double().pow(2).sum().item() for n, r in ref_params.items()))
        den = math.sqrt(sum(r.double().pow(2).sum().item() for r in ref_params.values()))
        assert num / den <= 2 ** -5, f"relative L2 error {num / den:.3g}"
    tol = 2e-2 if dtype != "fp32" else 1e-5
    for r, (_, _, _, losses, _) in enumerate(results):
        for a, b in zip(losses, ref_losses[r]):
            assert abs(a - b) <= tol * abs(b) + 1e-7, f"rank {r}: loss {a} vs {b}"


class _EagerAdagrad(torch.optim.Adagrad):
    """torch.optim.Adagrad as torch 2.4 constructs it: "step" and "sum" filled for every parameter in the
    constructor (later versions fill them at the first step)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p]["step"] = torch.tensor(0.0)
                    self.state[p]["sum"] = torch.full_like(p, group["initial_accumulator_value"])


def test_masters_take_over_the_state_an_eager_constructor_made_for_the_parameters():
    from zero_ext.optim.factory import adopt_masters

    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
    masters = [p.detach().clone().requires_grad_(True) for p in params]
    base = _EagerAdagrad(params, lr=0.1, initial_accumulator_value=0.25)
    base.param_groups[0]["params"] = list(masters)  # what the ZeRO optimizer's groups do
    adopt_masters(base)
    assert set(map(id, base.state)) == set(map(id, masters))  # the parameters' full-size sums are gone
    reference = [m.detach().clone().requires_grad_(True) for m in masters]
    plain = torch.optim.Adagrad(reference, lr=0.1, initial_accumulator_value=0.25)
    for opt, ps in ((base, masters), (plain, reference)):
        for p in ps:
            p.grad = torch.linspace(-1, 1, p.numel())
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(masters, reference))
