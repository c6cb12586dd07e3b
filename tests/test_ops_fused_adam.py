"""FusedAdam (deepspeed.ops.adam.FusedAdam): DeepSpeed's constructor, the C kernel on host tensors and
torch's fused kernel on accelerator tensors. Each mode steps as the torch optimizer it stands for (the C
kernel within test_ops_cpu_adam's bound, torch's fused kernel bit for bit); what it cannot do is refused;
ZeRO takes it as a client optimizer."""
import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP
from zero_ext.ops.adam import CPUAdam
from zero_ext.ops.fused_adam import FusedAdam, _fused_devices


def _train(make, steps=4):
    torch.manual_seed(0)
    model = MLP()
    opt = make(model.param_groups())
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model.loss(MLP.batch(4, gen)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def _worst(ours, theirs, lr):
    """test_ops_cpu_adam's bound: max |dp| / (|p| + lr)."""
    return max(((a - b).abs() / (b.abs() + lr)).max().item() for a, b in zip(ours, theirs))


@pytest.mark.parametrize("adam_w_mode,reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_each_mode_is_the_torch_optimizer(adam_w_mode, reference):
    # the groups decay 0.0 and 0.1: decoupled and L2 decay give different weights, so a mix-up fails
    ours, opt = _train(lambda g: FusedAdam(g, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, adam_w_mode=adam_w_mode))
    theirs, _ = _train(lambda g: reference(g, lr=1e-2, betas=(0.8, 0.99), eps=1e-7))
    other, _ = _train(lambda g: FusedAdam(g, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, adam_w_mode=not adam_w_mode))
    assert _worst(ours, theirs, 1e-2) <= 1e-6
    assert _worst(other, theirs, 1e-2) > 1e-4
    assert isinstance(opt, CPUAdam)  # host tensors: the C kernel, with the engine's fused unscale/clip
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1]
    assert opt.adam_w_mode == int(adam_w_mode)
    assert {k for s in opt.state.values() for k in s} == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.skipif("cpu" not in _fused_devices(), reason="this torch has no fused Adam kernel for CPU tensors")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_accelerator_path_is_torchs_fused_kernel(adam_w_mode, dtype):
    """The accelerator path, run on CPU tensors (torch has its fused kernel there too): torch's fused Adam(W)
    bit for bit, states in the parameter's dtype; a loss scale multiplies the gradient first, and a 16-bit
    copy receives the new parameter."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (5, 300)]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedAdam(params, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1, adam_w_mode=adam_w_mode)
    ref = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(refs, lr=1e-2, betas=(0.8, 0.99), eps=1e-7,
                                                                     weight_decay=0.1, fused=True)
    group = opt.param_groups[0]
    for step in range(1, 4):
        outs = [torch.empty(p.shape, dtype=torch.float16) for p in params]
        for p, r in zip(params, refs):
            r.grad = torch.randn(p.shape, generator=gen).to(dtype)
            p.grad = r.grad / 4
        for p in params:
            if not opt.state[p]:
                opt._init_state(p, opt.state[p])
        opt._device_step(group, [(p, opt.state[p], step, o) for p, o in zip(params, outs)], 4.0)
        ref.step()
        for p, r, o in zip(params, refs, outs):
            assert torch.equal(p, r) and torch.equal(o, p.detach().half())
    assert all(opt.state[p]["exp_avg"].dtype == dtype for p in params)


def test_refusals_and_zero_grad():
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([p], amsgrad=True)
    for set_grad_none, expect_none in ((True, True), (False, False)):
        opt = FusedAdam([p], set_grad_none=set_grad_none)
        p.grad = torch.ones(3)
        opt.zero_grad()
        assert (p.grad is None) == expect_none


def test_without_bias_correction():
    """bias_correction=False (torch's Adam cannot): the C kernel on host tensors, device_math elsewhere;
    the two agree, and differ from the corrected update."""
    def run(path):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(40))
        opt = FusedAdam([p], lr=1e-2, bias_correction=False)
        for step in range(1, 4):
            p.grad = torch.sin(p.detach() * step)
            if path == "host":
                opt.step()
            else:
                if not opt.state[p]:
                    opt._init_state(p, opt.state[p])
                opt._device_step(opt.param_groups[0], [(p, opt.state[p], step, None)], 1.0)
        return p.detach()
    corrected = FusedAdam([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]["bias_correction"]
    assert corrected
    host, device = run("host"), run("device")
    assert _worst([host], [device], 1e-2) <= 1e-5  # (device_math rounds sqrt and the division its own way)
    torch.manual_seed(0)
    q = torch.nn.Parameter(torch.randn(40))
    opt = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.0)
    for step in range(1, 4):
        q.grad = torch.sin(q.detach() * step)
        opt.step()
    assert _worst([host], [q.detach()], 1e-2) > 1e-4


def _zero2_with_fused_adam():
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    before = [p.detach().clone() for p in model.head.parameters()]
    opt = FusedAdam([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    engine, *_ = zero_ext.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(2):
        engine.backward(model.loss(MLP.batch(2, gen)))
        engine.step()
    out = [p.detach().clone() for p in model.parameters()]
    moved = all(not torch.equal(b, p) for b, p in zip(before, model.head.parameters()))
    engine.destroy()
    return out, moved


def test_zero_takes_it_as_a_client_optimizer():
    (a, moved_a), (b, moved_b) = run_ranks(2, _zero2_with_fused_adam)
    assert moved_a and moved_b and all(torch.equal(x, y) for x, y in zip(a, b))  # trained; the ranks agree
