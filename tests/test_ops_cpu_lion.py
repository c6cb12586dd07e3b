"""CPU Lion (csrc/cpu_optim_lion.c, zero_ext.ops.lion). torch has no Lion: the reference is the
published algorithm written in torch operations (as csrc/cpu_optim_lion.c documents), which every
path must match bit for bit, NaN and zero gradients included."""
import pytest
import torch

from zero_ext.ops import functional as F
from zero_ext.ops.lion import CPULion, DeepSpeedCPULion

from helpers.cpu_optim import ISAS, TORCH_VECTORISED

SIZES = [0, 1, 7, 17, 64, 65, 1000, 70001]
pytestmark = pytest.mark.usefixtures("two_threads")  # helpers/cpu_optim.py, in every test


def torch_lion(p, g, m, *, lr, beta1, beta2, weight_decay, grad_scale=1.0):
    g = g * grad_scale
    p.mul_(1 - lr * weight_decay)
    p.add_(m.lerp(g, 1 - beta1).sign(), alpha=-lr)
    m.lerp_(g, 1 - beta2)


@pytest.mark.skipif(not TORCH_VECTORISED, reason="torch runs without its AVX2/AVX-512 kernels (no FMA)")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.3, 0.4)])
def test_matches_torch_lion(isa, betas):
    gen = torch.Generator().manual_seed(0)
    hp = dict(lr=1e-3, beta1=betas[0], beta2=betas[1], weight_decay=0.1, grad_scale=0.5)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    refs = [p.clone() for p in params]
    m = [torch.zeros(n) for n in SIZES]
    rm = [torch.zeros(n) for n in SIZES]
    for s in range(10):
        grads = [torch.randn(n, generator=gen) for n in SIZES]
        for g in grads:
            g[::7] = 0.0  # zero gradients: sign 0 while m is 0
            g[3::97] = float("nan")
        F.lion_step(params, grads, m, isa=isa, **hp)
        for p, g, mm in zip(refs, grads, rm):
            torch_lion(p, g, mm, **hp)
    for a, b, x, y in zip(params, refs, m, rm):
        assert torch.equal(a, b), f"{isa} size {a.numel()}"
        assert torch.equal(torch.isnan(x), torch.isnan(y)) and torch.equal(x.nan_to_num(), y.nan_to_num())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1001, 4_200_001])  # the large call streams its copy
def test_copy_out(isa, n):
    p, g, m = torch.randn(n), torch.randn(n), torch.randn(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    F.lion_step([p], [g], [m], lr=1e-3, beta1=0.9, beta2=0.99, outs=[out], isa=isa)
    assert torch.equal(out.view(torch.int16), p.bfloat16().view(torch.int16))


def test_optimizer_class():
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 3)
    opt = DeepSpeedCPULion(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref = [p.detach().clone() for p in model.parameters()]
    rm = [torch.zeros_like(p) for p in ref]
    for _ in range(5):
        x = torch.randn(4, 7)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        for p, r, m in zip(model.parameters(), ref, rm):
            torch_lion(r, p.grad, m, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01)
        opt.step()
    for a, b in zip(model.parameters(), ref):
        assert ((a - b).abs() / (b.abs() + 1e-3)).max() <= 1e-6
    assert CPULion is DeepSpeedCPULion
    state = opt.state[model.weight]
    assert state["step"] == 5 and set(state) == {"step", "exp_avg"}
