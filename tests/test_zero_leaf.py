"""ZeRO-3 leaf modules: a mixture-of-experts block whose experts run in a data-dependent order."""
import pytest
import torch
from torch import nn

from helpers.harness import RankFailed, run_ranks


class Experts(nn.Module):
    """Routes each batch to one expert chosen by the data: ranks may run different experts."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        choice = int(x.sum().abs().item() * 1000) % 3
        return self.experts[choice](x)


class MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.moe = Experts()
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.moe(torch.tanh(self.inp(x)))))


def _config(leaf_names):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "leaf_module": {"names": leaf_names}}}


def _batches(world):
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(2 * world, 4, generator=gen), torch.randn(2 * world, 2, generator=gen)) for _ in range(4)]


def _train(leaf_names, mark_by_class, leaf_class=Experts):
    import zero_ext

    torch.manual_seed(0)
    model = MoEModel()
    if mark_by_class:
        zero_ext.zero.set_z3_leaf_modules(model, [leaf_class])
    engine = zero_ext.initialize(model=model, config=_config(leaf_names))[0]
    rank = torch.distributed.get_rank()
    for x, y in _batches(torch.distributed.get_world_size()):
        loss = (engine(x[2 * rank:2 * rank + 2]) - y[2 * rank:2 * rank + 2]).pow(2).mean()
        engine.backward(loss)
        engine.step()
    with zero_ext.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    leaves = [type(m).__name__ for m in zero_ext.zero.get_z3_leaf_modules(model)]
    engine.destroy()
    return params, leaves


@pytest.mark.parametrize("by_class, leaf_class", [(False, Experts), (True, Experts), (True, MoEModel)])
def test_a_leaf_gathers_its_subtree_so_data_dependent_experts_train(by_class, leaf_class):
    # MoEModel: the whole model is the leaf, and its input needs no gradient (DeepSpeed refuses such a
    # leaf; here the end-of-backward release covers it)
    results = run_ranks(2, _train, [] if by_class else ["moe"], by_class, leaf_class)
    torch.manual_seed(0)
    ref = MoEModel()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    for x, y in _batches(2):
        for r in range(2):
            ((ref(x[2 * r:2 * r + 2]) - y[2 * r:2 * r + 2]).pow(2).mean() / 2).backward()
        for p in ref.parameters():  # experts unused on both ranks have no gradient; ZeRO treats it as 0
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    for params, leaves in results:
        assert leaves == [leaf_class.__name__]
        for n, p in ref.named_parameters():
            assert ((params[n] - p.detach()).abs() <= 1e-5 * (p.detach().abs() + 1e-2)).all(), n


def test_without_the_leaf_the_diverging_ranks_are_named():
    with pytest.raises(RankFailed, match="FetchOrderError"):
        run_ranks(2, _train, [], False)
