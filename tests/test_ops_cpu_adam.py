"""CPU Adam (csrc/cpu_adam.c, zero_ext.ops.adam): every ISA path against torch.optim.Adam/AdamW.

Two references. torch.optim.Adam/AdamW(foreach=False) itself, with the issue's bound
max |dp| / (|p| + lr) <= 1e-6 over 10 steps; and the same torch operations with a correctly rounded
sqrt (torch's vectorised sqrt is not: about 0.7% of its results are 1 ulp off), which every path
must match bit for bit, since the kernels do torch's operations in torch's order with torch's FMAs.
The bf16/fp16 copies must equal torch's .to() of our own fp32 result bit for bit.
"""
import os
import threading

import pytest
import torch

from zero_ext import _C
from zero_ext.ops import functional as F
from zero_ext.ops.adam import CPUAdam, DeepSpeedCPUAdam

from helpers import ROOT
from helpers.cpu_optim import ISAS, TORCH_VECTORISED

# sizes around the vector widths (8, 16), the AVX2 block (64), 128 and the tile
# (32768), in one call
SIZES = [0, 1, 7, 8, 15, 16, 17, 63, 64, 65, 127, 128, 129, 143, 1000, 4099, 70001]


def rand_list(sizes, gen, scale=1.0):
    return [torch.randn(n, generator=gen) * scale for n in sizes]


def ieee_adam(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step, adamw_mode=True, bias_correction=True,
              grad_scale=1.0):
    """torch.optim.Adam's single-tensor step, op for op, with a correctly rounded sqrt."""
    g = g * grad_scale
    if weight_decay != 0:
        if adamw_mode:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    denom = (v.double().sqrt().float() / bc2 ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / bc1))


def run_ours(isa, sizes, steps, gen, hp, grad_scale=1.0, grads=None):
    params = rand_list(sizes, gen)
    grads = grads or [rand_list(sizes, gen) for _ in range(steps)]
    m = [torch.zeros(n) for n in sizes]
    v = [torch.zeros(n) for n in sizes]
    start = [p.clone() for p in params]
    for s in range(steps):
        F.adam_step(params, grads[s], m, v, step=s + 1, grad_scale=grad_scale, isa=isa, **hp)
    return start, grads, params, m, v


HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch_adam(isa, adamw_mode, two_threads):
    gen = torch.Generator().manual_seed(1)
    hp = dict(HP, adamw_mode=adamw_mode)
    start, grads, params, m, v = run_ours(isa, SIZES, 10, gen, hp)
    refs = [torch.nn.Parameter(p.clone()) for p in start]
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = cls(refs, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
              weight_decay=hp["weight_decay"], foreach=False)
    for s in range(10):
        for r, g in zip(refs, grads[s]):
            r.grad = g.clone()
        opt.step()
    worst = 0.0
    for r, p, mi, vi in zip(refs, params, m, v):
        if p.numel() == 0:
            continue
        worst = max(worst, ((p - r.detach()).abs() / (r.detach().abs() + hp["lr"])).max().item())
        torch.testing.assert_close(mi, opt.state[r]["exp_avg"], rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(vi, opt.state[r]["exp_avg_sq"], rtol=1e-6, atol=1e-12)
    assert worst <= 1e-6, f"{isa}: max |dp|/(|p|+lr) = {worst:.3g}"


@pytest.mark.skipif(not TORCH_VECTORISED, reason="torch runs without its AVX2/AVX-512 kernels (no FMA)")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", ["adamw", "adam_l2", "no_bias_correction", "beta1_low", "grad_scale", "no_decay"])
def test_bit_exact_with_ieee_sqrt(isa, case, two_threads):
    hp = dict(HP)
    grad_scale = 1.0
    if case == "adam_l2":
        hp["adamw_mode"] = False
    elif case == "no_bias_correction":
        hp["bias_correction"] = False
    elif case == "beta1_low":  # 1 - beta1 >= 0.5: torch's lerp takes its other formula
        hp.update(beta1=0.3, beta2=0.6)
    elif case == "grad_scale":
        grad_scale = 1 / 1024 * 0.37
    elif case == "no_decay":
        hp["weight_decay"] = 0.0
    gen = torch.Generator().manual_seed(2)
    start, grads, params, m, v = run_ours(isa, SIZES, 10, gen, hp, grad_scale=grad_scale)
    ref_hp = {k: hp[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay")}
    for p0, p, mi, vi, i in zip(start, params, m, v, range(len(SIZES))):
        rp, rm, rv = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for s in range(10):
            ieee_adam(rp, grads[s][i], rm, rv, step=s + 1, adamw_mode=hp.get("adamw_mode", True),
                      bias_correction=hp.get("bias_correction", True), grad_scale=grad_scale, **ref_hp)
        assert torch.equal(p, rp), f"{isa} {case} size {p.numel()}: params differ"
        assert torch.equal(mi, rm) and torch.equal(vi, rv), f"{isa} {case} size {p.numel()}: state differs"


def test_paths_agree_bit_for_bit(two_threads):
    results = []
    for isa in ISAS:
        gen = torch.Generator().manual_seed(3)
        results.append(run_ours(isa, SIZES, 5, gen, HP)[2:])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def bits(t):
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


def special_values(n, gen):
    """Random normals with subnormals, huge values, infinities, NaNs and rounding ties mixed in."""
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-40, 39, (n,), generator=gen).float()
    raw = torch.tensor([0x00000001, 0x807FFFFF, 0x00400000, 0x7F7FFFFF, 0x477FF000, 0x477FEFFF, 0x387FC000,
                        0x33000000, 0x33000001, 0x3F808000, 0x3F818000, 0x7F800000, 0xFF800000, 0x7FC00000,
                        0xFFC00000, 0x7F812345, 0xFF800001, 0x80000000], dtype=torch.int64)
    raw = raw.to(torch.int32).view(torch.float32)
    idx = torch.randint(0, n, (n // 4,), generator=gen)
    x[idx] = raw[torch.randint(0, len(raw), (len(idx),), generator=gen)]
    return x


def assert_same_bits(ours, ref, what):
    """The same bits; where ref is NaN only a NaN, unless torch's vectorised cast (whose NaNs we match)
    made ref. A NaN's bits are torch's own choice: its scalar cast writes bf16 NaN as 0x7FC0 where the
    vectorised one writes 0xFFFF, and torch 2.4 wrote every fp16 NaN as 0x7FFF (2.15 keeps the sign and
    the quiet bit, as the kernel does)."""
    old_torch = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5)
    if TORCH_VECTORISED and not (ref.dtype == torch.float16 and old_torch):
        assert torch.equal(bits(ours), bits(ref)), what
    else:
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(ours), nan) and torch.equal(bits(ours)[~nan], bits(ref)[~nan]), what


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_out_equals_torch_cast(isa, dtype, two_threads):
    gen = torch.Generator().manual_seed(4)
    sizes = [1, 17, 100, 70001]
    params = [special_values(n, gen) for n in sizes]
    grads = [special_values(n, gen) for n in sizes]
    m = [torch.randn(n, generator=gen) for n in sizes]
    v = [torch.rand(n, generator=gen) for n in sizes]
    outs = [torch.empty(n, dtype=dtype) for n in sizes]
    outs[1] = None  # a tensor without a copy in the same call
    for lr in (0.0, 1e-3):  # lr 0 keeps the special parameter values as they are
        F.adam_step(params, grads, m, v, step=3, isa=isa, outs=outs, **dict(HP, lr=lr))
        for p, o in zip(params, outs):
            if o is not None:
                assert_same_bits(o, p.to(dtype), f"{isa} {dtype} lr={lr}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_all_exponents(isa, dtype):
    """Every sign/exponent/top-mantissa pattern (the upper 16 bits) with low halves at and around
    the rounding ties, against torch's .to()."""
    hi = torch.arange(65536, dtype=torch.int64) << 16
    lows = torch.tensor([0, 1, 0x0FFF, 0x1000, 0x1001, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    x = (hi[:, None] | lows[None, :]).flatten().to(torch.int32).view(torch.float32).contiguous()
    out = torch.empty(x.numel(), dtype=dtype)
    F.cast_(out, x, isa=isa)
    assert_same_bits(out, x.to(dtype), f"{isa} {dtype}")


@pytest.mark.parametrize("isa", ISAS)
def test_edge_cases_follow_torch(isa):
    """Zero, huge and tiny gradients, NaN and Inf in gradients: the same values (NaN where torch
    has NaN) as torch.optim.AdamW, never a crash."""
    n = 200
    p = torch.randn(n)
    g = torch.randn(n)
    g[:20] = 0.0
    g[20:40] = 1e30  # g*g overflows to inf: v = inf, the update 0 (or NaN once m is inf too)
    g[40:60] = 1e-30
    g[60:70] = float("nan")
    g[70:80] = float("inf")
    g[80:90] = -float("inf")
    ours = [p.clone()]
    m, v = [torch.zeros(n)], [torch.zeros(n)]
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01, foreach=False)
    for s in range(3):
        F.adam_step(ours, [g], m, v, step=s + 1, isa=isa, **HP)
        ref.grad = g.clone()
        opt.step()
    r = ref.detach()
    assert torch.equal(torch.isnan(ours[0]), torch.isnan(r))
    ok = ~torch.isnan(r)
    assert (((ours[0] - r).abs() / (r.abs() + 1e-3))[ok] <= 1e-6).all()
    assert torch.equal(torch.isnan(m[0]), torch.isnan(opt.state[ref]["exp_avg"]))
    assert torch.equal(torch.isinf(v[0]), torch.isinf(opt.state[ref]["exp_avg_sq"]))


def test_threads_do_not_change_results():
    gen = torch.Generator().manual_seed(5)
    grads = [rand_list([300001, 5], gen) for _ in range(3)]
    out = []
    for n in (1, 2, 3):
        F.set_num_threads(n)
        try:
            assert F.get_num_threads() == n
            out.append(run_ours(None, [300001, 5], 3, torch.Generator().manual_seed(6), HP, grads=grads)[2:])
        finally:
            F.set_num_threads(None)
    for other in out[1:]:
        for a, b in zip(out[0], other):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert F.get_num_threads() == torch.get_num_threads()



def subnormal_case(n, gen):
    """An Adam state where squares and decays land below float32's normal range: zero and tiny
    gradients, exp_avg_sq already subnormal in places (a parameter with no gradient for ~60k steps)."""
    tiny = torch.finfo(torch.float32).tiny
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * torch.where(torch.rand(n, generator=gen) < 0.5, 1e-21, 1e-3)
    g[torch.rand(n, generator=gen) < 0.25] = 0.0
    m = torch.randn(n, generator=gen) * 1e-30
    v = torch.rand(n, generator=gen) * torch.where(torch.rand(n, generator=gen) < 0.5, tiny * 4, 1e-8)
    return p, g, m, v


def n_subnormal(t):
    return int(((t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)).sum())


@pytest.mark.skipif(not TORCH_VECTORISED, reason="torch runs without its AVX2/AVX-512 kernels (no FMA)")
@pytest.mark.parametrize("isa", ISAS)
def test_flush_denormal_mode_reaches_every_thread(isa, two_threads):
    """torch.set_flush_denormal(True) (the caller's MXCSR: flush to zero, denormals are zero) holds
    on the pool's threads too: every tile of a call flushes as the reference does on the caller's
    thread. Subnormal state makes each vector operation take a microcode assist on x86 (the step
    over 1e8 elements of a deep model's state, 23 % subnormal, ran 2.4x slower than flushed);
    flushing is the user's choice, as with torch, and without it results keep their subnormals."""
    n = 5 * 32768 + 77  # six tiles: both threads take some
    hp = dict(HP, step=7)
    torch_threads = torch.get_num_threads()
    for flush in (False, True):
        p, g, m, v = subnormal_case(n, torch.Generator().manual_seed(11))
        refs = [t.clone() for t in (p, m, v)]
        torch.set_num_threads(1)  # the reference on this thread only: its MXCSR is the one set
        assert torch.set_flush_denormal(flush)
        try:
            ieee_adam(refs[0], g, refs[1], refs[2], **hp)
            F.adam_step([p], [g], [m], [v], isa=isa, **hp)
        finally:
            torch.set_flush_denormal(False)
            torch.set_num_threads(torch_threads)
        assert torch.equal(p, refs[0]) and torch.equal(m, refs[1]) and torch.equal(v, refs[2]), f"flush={flush}"
        if flush:
            assert n_subnormal(v) == n_subnormal(m) == n_subnormal(p) == 0
        else:
            assert n_subnormal(v) > n // 20  # the case does produce subnormals


# ---------------------------------------------------------------------------------------------------
# The gradient norm pass and the floor kernel


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_sqnorm_with_copy(isa, dtype, two_threads):
    gen = torch.Generator().manual_seed(7)
    for n in (0, 1, 15, 100, 123457):
        src = (torch.randn(n, generator=gen) * 3).to(dtype)
        out = torch.full((n,), 7.0)
        got = F.grad_sqnorm(src, out=out, isa=isa)
        want = src.double().pow(2).sum().item()
        assert got == pytest.approx(want, rel=1e-12, abs=1e-300)
        assert torch.equal(out, src.float())
        assert F.grad_sqnorm(src, isa=isa) == got  # without the copy: the same sum
    bad = torch.randn(1000).to(dtype)
    bad[500] = float("inf")
    assert F.grad_sqnorm(bad, isa=isa) == float("inf")
    bad[501] = float("nan")
    assert F.grad_sqnorm(bad, isa=isa) != F.grad_sqnorm(bad, isa=isa)  # NaN


def test_grad_sqnorm_independent_of_threads():
    g = torch.randn(1 << 20)
    sums = []
    for n in (1, 2):
        F.set_num_threads(n)
        try:
            sums.append(F.grad_sqnorm(g))
        finally:
            F.set_num_threads(None)
    assert sums[0] == sums[1]


@pytest.mark.parametrize("isa", ISAS)
def test_membw_floor_moves_adams_bytes(isa):
    gen = torch.Generator().manual_seed(8)
    sizes = [3, 100, 1000]
    p, g, m, v = (rand_list(sizes, gen) for _ in range(4))
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    want = [(a + d, b + d, c + d) for a, b, c, d in zip(p, m, v, g)]
    F.membw_adam(p, g, m, v, outs=outs, isa=isa)
    for (wp, wm, wv), a, b, c, o in zip(want, p, m, v, outs):
        assert torch.equal(a, wp) and torch.equal(b, wm) and torch.equal(c, wv)
        assert torch.equal(o.view(torch.int16), (a.view(torch.int32) >> 16).to(torch.int16))


# ---------------------------------------------------------------------------------------------------
# Argument checks: Python refuses what C cannot check, C refuses what slips through


def test_functional_refuses_bad_tensors():
    p, g, m, v = (torch.zeros(10) for _ in range(4))
    with pytest.raises(TypeError, match="float32"):
        F.adam_step([p.double()], [g], [m], [v], step=1, **HP)
    with pytest.raises(ValueError, match="contiguous"):
        F.adam_step([torch.zeros(10, 2).t()[0]], [g], [m], [v], step=1, **HP)
    with pytest.raises(ValueError, match="elements"):
        F.adam_step([p], [torch.zeros(9)], [m], [v], step=1, **HP)
    with pytest.raises(ValueError, match="entries"):
        F.adam_step([p], [g, g], [m], [v], step=1, **HP)
    with pytest.raises(ValueError, match="CPU tensors"):
        F.adam_step([torch.zeros(10, device="meta")], [g], [m], [v], step=1, **HP)
    with pytest.raises(ValueError, match="step"):
        F.adam_step([p], [g], [m], [v], step=0, **HP)
    with pytest.raises(ValueError, match="isa"):
        F.adam_step([p], [g], [m], [v], step=1, isa="neon", **HP)
    with pytest.raises(TypeError, match="bfloat16 or all float16"):
        F.adam_step([p, p], [g, g], [m, m], [v, v], step=1,
                    outs=[torch.empty(10, dtype=torch.bfloat16), torch.empty(10, dtype=torch.float16)], **HP)


def test_c_refuses_misaligned_and_negative():
    buf = torch.zeros(64)
    ptr = buf.data_ptr()
    args = (0.0, 0.9, 0.999, 1e-8, 0.0, 1, True, True, 1.0)
    with pytest.raises(ValueError, match="adam_step: invalid argument"):
        _C.adam_step([ptr + 2], [ptr], [ptr], [ptr], None, [4], 2, *args)
    with pytest.raises(ValueError, match="invalid argument"):
        _C.adam_step([ptr], [ptr], [ptr], [ptr], None, [-1], 2, *args)
    with pytest.raises(ValueError, match="invalid argument"):
        _C.adam_step([0], [ptr], [ptr], [ptr], None, [4], 2, *args)
    with pytest.raises(ValueError, match="invalid argument"):  # unknown copy-out dtype
        _C.adam_step([ptr], [ptr + 64], [ptr + 128], [ptr + 192], [ptr + 224], [4], 0, *args)
    with pytest.raises(ValueError, match="invalid argument"):
        _C.adam_step([ptr], [ptr], [ptr], [ptr], None, [4], 2, *args, 7)  # isa 7
    with pytest.raises(ValueError, match="numels"):
        _C.adam_step([ptr], [ptr], [ptr], [ptr], None, [4, 4], 2, *args)
    with pytest.raises(ValueError, match="cpu_optim_set_threads"):
        _C.cpu_optim_set_threads(0)
    _C.adam_step([], [], [], [], None, [], 2, *args)  # nothing to do is fine


# ---------------------------------------------------------------------------------------------------
# The optimizer class


def make_pair(seed=0, **kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 9), torch.nn.ReLU(), torch.nn.Linear(9, 5))
    ref = torch.nn.Sequential(torch.nn.Linear(12, 9), torch.nn.ReLU(), torch.nn.Linear(9, 5))
    ref.load_state_dict(model.state_dict())
    return model, ref


def train(model, opt, steps, seed=1, **step_kw):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step(**step_kw)


def assert_params_close(a, b, lr):
    for x, y in zip(a.parameters(), b.parameters()):
        assert ((x - y).abs() / (y.abs() + lr)).max().item() <= 1e-6


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_trains_like_torch(adamw_mode):
    model, ref = make_pair()
    groups = lambda m: [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 3e-3}]  # noqa: E731
    opt = CPUAdam(groups(model), lr=1e-3, weight_decay=0.05, adamw_mode=adamw_mode)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ropt = cls(groups(ref), lr=1e-3, weight_decay=0.05, foreach=False)
    train(model, opt, 10)
    train(ref, ropt, 10)
    assert_params_close(model, ref, 1e-3)
    state = opt.state[model[0].weight]
    assert state["step"] == 10 and set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["exp_avg"].dtype == torch.float32


def test_state_dict_round_trip():
    model, ref = make_pair()
    opt = DeepSpeedCPUAdam(model.parameters(), lr=2e-3, weight_decay=0.01)
    ropt = DeepSpeedCPUAdam(ref.parameters(), lr=2e-3, weight_decay=0.01)
    train(model, opt, 4)
    train(ref, ropt, 4)
    sd = opt.state_dict()
    fresh = DeepSpeedCPUAdam(model.parameters(), lr=2e-3, weight_decay=0.01)
    fresh.load_state_dict(sd)
    train(model, fresh, 3, seed=2)
    train(ref, ropt, 3, seed=2)
    for x, y in zip(model.parameters(), ref.parameters()):
        assert torch.equal(x, y)
    assert fresh.state[model[0].weight]["step"] == 7


def test_loads_torch_adam_state():
    """A torch.optim.AdamW state_dict (tensor steps) continues in CPUAdam as it would in torch."""
    model, ref = make_pair()
    topt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    train(model, topt, 3)
    train(ref, ropt, 3)
    opt = CPUAdam(model.parameters(), lr=1e-3)
    opt.load_state_dict(topt.state_dict())
    train(model, opt, 3, seed=2)
    train(ref, ropt, 3, seed=2)
    assert_params_close(model, ref, 1e-3)
    assert opt.state[model[0].weight]["step"] == 6


def test_fused_copy_out_and_grad_scale():
    model, ref = make_pair()
    opt = CPUAdam(model.parameters(), lr=1e-3)
    ropt = CPUAdam(ref.parameters(), lr=1e-3)
    half = [torch.empty_like(p, dtype=torch.bfloat16) for p in model.parameters()]
    half[1] = torch.empty_like(half[1], dtype=torch.float32)  # not fusable: copied after the call
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 12, generator=gen)
    for m in (model, ref):
        m(x).pow(2).mean().mul(512.0).backward()
    opt.step(fp16_param_groups=[half], grad_scale=1 / 512)
    for p in ref.parameters():
        p.grad.mul_(1 / 512)
    ropt.step()
    for p, r, h in zip(model.parameters(), ref.parameters(), half):
        assert torch.equal(p, r)
        assert torch.equal(h, p.to(h.dtype))


def test_params_it_cannot_take_in_place():
    """A non-contiguous fp32 parameter, and bf16 parameters with fp32 or bf16 state."""
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    p = torch.nn.Parameter(base.t())  # non-contiguous
    r = torch.nn.Parameter(base.t().contiguous())
    opt, ropt = CPUAdam([p], weight_decay=0.1), torch.optim.AdamW([r], weight_decay=0.1, foreach=False)
    for _ in range(3):
        g = torch.randn(4, 6)
        p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ropt.step()
    assert ((p - r).abs() / (r.abs() + 1e-3)).max() <= 1e-6
    for fp32_states in (True, False):
        b = torch.nn.Parameter(torch.randn(50).bfloat16())
        f = torch.nn.Parameter(b.detach().float())
        opt = CPUAdam([b], lr=1e-2, fp32_optimizer_states=fp32_states)
        fopt = CPUAdam([f], lr=1e-2)
        g = torch.randn(50)
        b.grad, f.grad = g.bfloat16(), g.bfloat16().float()
        opt.step()
        fopt.step()
        assert opt.state[b]["exp_avg"].dtype == (torch.float32 if fp32_states else torch.bfloat16)
        assert torch.equal(b.detach(), f.detach().bfloat16())


def test_keeps_fp32_state_of_bf16_params_through_load():
    b = torch.nn.Parameter(torch.randn(20).bfloat16())
    opt = CPUAdam([b])
    b.grad = torch.randn(20).bfloat16()
    opt.step()
    m = opt.state[b]["exp_avg"].clone()
    opt2 = CPUAdam([b])
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[b]["exp_avg"].dtype == torch.float32 and torch.equal(opt2.state[b]["exp_avg"], m)


def test_refusals():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="AMSGrad"):
        CPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="beta"):
        CPUAdam([p], betas=(1.0, 0.9))
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    meta.grad = torch.zeros(3, device="meta")
    with pytest.raises(RuntimeError, match="offload_optimizer"):
        CPUAdam([meta]).step()
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        CPUAdam([p]).step()


def test_parameters_without_grad_and_unequal_steps():
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(7))
    opt = CPUAdam([a, b], lr=1e-2)
    a.grad = torch.randn(5)
    opt.step()  # b has no grad: no state, no step
    assert b not in opt.state and opt.state[a]["step"] == 1
    b.grad = torch.randn(7)
    ra, rb = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
    ropt = torch.optim.AdamW([ra, rb], lr=1e-2, weight_decay=0.0, foreach=False)
    ropt.state[ra] = {"step": torch.tensor(1.0), "exp_avg": opt.state[a]["exp_avg"].clone(),
                      "exp_avg_sq": opt.state[a]["exp_avg_sq"].clone()}
    ra.grad, rb.grad = a.grad.clone(), b.grad.clone()
    opt.step()  # a at step 2, b at step 1: two C calls
    ropt.step()
    assert opt.state[a]["step"] == 2 and opt.state[b]["step"] == 1
    for x, y in ((a, ra), (b, rb)):
        assert ((x - y).abs() / (y.abs() + 1e-2)).max() <= 1e-6


def test_concurrent_steps_from_two_threads(two_threads):
    """The binding releases the GIL and the pool serializes runs: two Python threads stepping
    at once both get correct results."""
    gen = torch.Generator().manual_seed(9)
    jobs = []
    for _ in range(2):
        p, g = torch.randn(200003, generator=gen), torch.randn(200003, generator=gen)
        ref = (p.clone(), torch.zeros_like(p), torch.zeros_like(p))
        for s in range(3):
            F.adam_step([ref[0]], [g], [ref[1]], [ref[2]], step=s + 1, **HP)
        jobs.append(([p], [g], [torch.zeros_like(p)], [torch.zeros_like(p)], ref))

    def work(job):
        for s in range(3):
            F.adam_step(*job[:4], step=s + 1, **HP)

    threads = [threading.Thread(target=work, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job in jobs:
        assert torch.equal(job[0][0], job[4][0])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_pool_survives_fork(two_threads):
    """The child of a fork has no pool workers; its first step starts new ones (atfork handler)."""
    p, g = torch.randn(100000), torch.randn(100000)
    F.adam_step([p.clone()], [g], [torch.zeros_like(p)], [torch.zeros_like(p)], step=1, **HP)  # pool running
    want = p.clone()
    F.adam_step([want], [g], [torch.zeros_like(p)], [torch.zeros_like(p)], step=1, **HP)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    pid = os.fork()
    if pid == 0:  # child: only C and numpy, no torch ops
        try:
            F.adam_step([p], [g], [m], [v], step=1, **HP)
            os._exit(0 if p.numpy().tobytes() == want.numpy().tobytes() else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_division_by_the_bias_correction_in_double_is_exact():
    """The kernels divide sqrt(v) by b = sqrt(1 - beta2^t) as s * (1/b) in double (csrc/cpu_adam.c
    proves it equals the fp32 division): check on random s and on every b of 2000 steps."""
    import numpy as np

    rng = np.random.default_rng(0)
    s = (rng.random(1 << 20) * 2.0 ** rng.integers(-60, 60, 1 << 20)).astype(np.float32)
    for beta2 in (0.999, 0.95, 0.5):
        for t in list(range(1, 200)) + list(range(200, 2000, 37)):
            b = np.float32((1 - beta2 ** t) ** 0.5)
            exact = s / b
            fast = (s.astype(np.float64) * (1.0 / np.float64(b))).astype(np.float32)
            assert np.array_equal(exact, fast), (beta2, t)


def test_c_internals(tmp_path):
    """tests/c/test_cpu_optim.c: the tile driver visits every element once (any sizes, threads,
    pool resizes), and the scalar conversions equal the vector instructions on every input class."""
    import shutil
    import subprocess
    import sysconfig

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(cc):
        pytest.skip(f"no C compiler ({cc}) to build tests/c/test_cpu_optim.c")
    exe = str(tmp_path / "test_cpu_optim")
    srcs = ["tests/c/test_cpu_optim.c", "csrc/cpu_optim.c", "csrc/thread_pool.c", "csrc/cpu_features.c"]
    build = subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
                            "-Icsrc", *srcs, "-lpthread", "-lm", "-o", exe],
                           cwd=ROOT, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    if run.returncode == 77:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("isa", ISAS)
def test_large_call_streams_copy(isa, two_threads):
    """Calls of >= 4M elements write the copy with non-temporal stores where it is aligned: an
    aligned and a misaligned (1 element in) copy in one call, against torch's cast; also for the
    floor kernel and cast_."""
    gen = torch.Generator().manual_seed(10)
    sizes = [3_000_001, 1_500_017]
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    m = [torch.zeros(n) for n in sizes]
    v = [torch.zeros(n) for n in sizes]
    backing = torch.empty(sizes[1] + 1, dtype=torch.bfloat16)
    outs = [torch.empty(sizes[0], dtype=torch.bfloat16), backing[1:]]
    F.adam_step(params, grads, m, v, step=1, outs=outs, isa=isa, **HP)
    for p, o in zip(params, outs):
        assert torch.equal(bits(o), bits(p.to(torch.bfloat16)))
    half = torch.empty(sizes[0], dtype=torch.float16)
    F.cast_(half, params[0], isa=isa)
    assert torch.equal(bits(half), bits(params[0].half()))
    want = [(p + g).view(torch.int32) >> 16 for p, g in zip(params, grads)]
    F.membw_adam(params, grads, m, v, outs=outs, isa=isa)
    for w, o in zip(want, outs):
        assert torch.equal(o.view(torch.int16).to(torch.int32) & 0xFFFF, w & 0xFFFF)


def test_large_state_on_huge_pages_saves_loads_and_steps_the_same():
    """State of a parameter from 2 MiB up lives on a huge-page mapping (host_buffers.host_empty), each
    tensor on its own cache colour: it saves, loads (into such mappings again) and steps exactly like
    small state."""
    import io

    from zero_ext.offload.host_buffers import COLOUR_BYTES, COLOURS

    def on_huge_pages_coloured(state):
        starts = [state[k].data_ptr() for k in ("exp_avg", "exp_avg_sq")]
        # its own 2 MiB-aligned mapping (not torch's allocator), offset by a colour
        assert all(a % (2 << 20) % COLOUR_BYTES == 0 and a % (2 << 20) < COLOURS * COLOUR_BYTES for a in starts)
        assert starts[0] % 4096 != starts[1] % 4096  # successive tensors: different colours

    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(1 << 20, generator=gen))
    p.grad = torch.randn(1 << 20, generator=gen)
    opt = CPUAdam([p], lr=1e-2)
    opt.step()
    on_huge_pages_coloured(opt.state[p])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    again = CPUAdam([q], lr=1e-2)
    again.load_state_dict(torch.load(buf))
    on_huge_pages_coloured(again.state[q])
    for o in (opt, again):
        o.step()
    assert torch.equal(p, q)
    assert torch.equal(opt.state[p]["exp_avg_sq"], again.state[q]["exp_avg_sq"])
