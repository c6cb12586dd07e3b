"""FusedAdam (deepspeed.ops.adam.FusedAdam): torch's Adam with DeepSpeed's FusedAdam constructor. Each mode
steps as the torch optimizer it stands for, bit for bit; what it cannot do is refused; ZeRO takes it as a
client optimizer."""
import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP
from zero_ext.ops.fused_adam import FusedAdam


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


@pytest.mark.parametrize("adam_w_mode,reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_each_mode_is_the_torch_optimizer_bit_for_bit(adam_w_mode, reference):
    # the groups decay 0.0 and 0.1: decoupled and L2 decay give different weights, so a mix-up fails
    ours, opt = _train(lambda g: FusedAdam(g, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, adam_w_mode=adam_w_mode))
    theirs, _ = _train(lambda g: reference(g, lr=1e-2, betas=(0.8, 0.99), eps=1e-7))
    other, _ = _train(lambda g: FusedAdam(g, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, adam_w_mode=not adam_w_mode))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert not all(torch.equal(a, b) for a, b in zip(ours, other))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.1]  # restored after each step
    assert opt.adam_w_mode == int(adam_w_mode)
    assert {k for s in opt.state.values() for k in s} == {"step", "exp_avg", "exp_avg_sq"}


def test_refusals_and_zero_grad():
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([p], amsgrad=True)
    with pytest.raises(NotImplementedError, match="bias_correction"):
        FusedAdam([p], bias_correction=False)
    for set_grad_none, expect_none in ((True, True), (False, False)):
        opt = FusedAdam([p], set_grad_none=set_grad_none)
        p.grad = torch.ones(3)
        opt.zero_grad()
        assert (p.grad is None) == expect_none


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
