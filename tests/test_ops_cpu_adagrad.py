"""CPU Adagrad (csrc/cpu_optim_adagrad.c, zero_ext.ops.adagrad): every ISA path against
torch.optim.Adagrad(foreach=False), and bit for bit against torch's operations with a correctly
rounded sqrt (see test_ops_cpu_adam.py for why)."""
import pytest
import torch

from zero_ext.ops import functional as F
from zero_ext.ops.adagrad import CPUAdagrad, DeepSpeedCPUAdagrad

from helpers.cpu_optim import ISAS, TORCH_VECTORISED

SIZES = [0, 1, 7, 17, 64, 65, 1000, 70001]
pytestmark = pytest.mark.usefixtures("two_threads")  # helpers/cpu_optim.py, in every test


def ours(isa, wd, grad_scale=1.0, steps=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    grads = [[torch.randn(n, generator=gen) for n in SIZES] for _ in range(steps)]
    start = [p.clone() for p in params]
    sums = [torch.zeros(n) for n in SIZES]
    for s in range(steps):
        F.adagrad_step(params, grads[s], sums, lr=1e-2, eps=1e-10, weight_decay=wd, grad_scale=grad_scale, isa=isa)
    return start, grads, params, sums


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_adagrad(isa, wd):
    start, grads, params, sums = ours(isa, wd)
    refs = [torch.nn.Parameter(p.clone()) for p in start]
    opt = torch.optim.Adagrad(refs, lr=1e-2, eps=1e-10, weight_decay=wd, foreach=False)
    for s in range(10):
        for r, g in zip(refs, grads[s]):
            r.grad = g.clone()
        opt.step()
    for r, p, sm in zip(refs, params, sums):
        if p.numel():
            assert ((p - r.detach()).abs() / (r.detach().abs() + 1e-2)).max() <= 1e-6
            torch.testing.assert_close(sm, opt.state[r]["sum"], rtol=1e-6, atol=0)


@pytest.mark.skipif(not TORCH_VECTORISED, reason="torch runs without its AVX2/AVX-512 kernels (no FMA)")
@pytest.mark.parametrize("isa", ISAS)
def test_bit_exact_with_ieee_sqrt(isa):
    scale = 0.25
    start, grads, params, sums = ours(isa, 0.1, grad_scale=scale)
    for i, (p0, p, sm) in enumerate(zip(start, params, sums)):
        rp, rs = p0.clone(), torch.zeros_like(p0)
        for s in range(10):
            g = (grads[s][i] * scale).add(rp, alpha=0.1)
            rs.addcmul_(g, g, value=1)
            rp.addcdiv_(g, rs.double().sqrt().float().add_(1e-10), value=-1e-2)
        assert torch.equal(p, rp) and torch.equal(sm, rs), f"{isa} size {p.numel()}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1001, 4_200_001])  # the large call streams its copy
def test_copy_out(isa, n):
    p, g, s = torch.randn(n), torch.randn(n), torch.rand(n)
    out = torch.empty(n, dtype=torch.float16)
    F.adagrad_step([p], [g], [s], lr=1e-2, eps=1e-10, outs=[out], isa=isa)
    assert torch.equal(out.view(torch.int16), p.half().view(torch.int16))


def test_optimizer_class():
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 3)
    ref = torch.nn.Linear(7, 3)
    ref.load_state_dict(model.state_dict())
    opt = DeepSpeedCPUAdagrad(model.parameters(), lr=1e-2, weight_decay=0.01)
    ropt = torch.optim.Adagrad(ref.parameters(), lr=1e-2, eps=1e-10, weight_decay=0.01, foreach=False)
    for _ in range(5):
        x = torch.randn(4, 7)
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert ((a - b).abs() / (b.abs() + 1e-2)).max() <= 1e-6
    assert CPUAdagrad is DeepSpeedCPUAdagrad
    state = opt.state[model.weight]
    assert state["step"] == 5 and set(state) == {"step", "exp_avg_sq"}
    fresh = CPUAdagrad(model.parameters())
    fresh.load_state_dict(opt.state_dict())
    assert torch.equal(fresh.state[model.weight]["exp_avg_sq"], state["exp_avg_sq"])
