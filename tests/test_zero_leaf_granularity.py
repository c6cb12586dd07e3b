"""stage3_module_granularity_threshold: ZeRO-3 marks as leaf modules the outermost modules whose parameter
elements per layer are at most the threshold (DeepSpeed's granularity), so a data-dependent block (experts
chosen per batch) trains as it does when marked by hand."""
import logging
import sys

import pytest
import torch
from torch import nn

from helpers.harness import run_ranks


class Experts(nn.Module):
    """Runs one expert chosen by the data: ranks may run different ones (per-child hooks would disagree)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        return self.experts[int(x.sum().abs().item() * 1000) % 3](x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)  # 30 elements
        self.moe = Experts()  # 3 x 42 elements, 3 layers + itself: granularity 126 // 4 = 31
        self.out = nn.Linear(6, 60)  # 420 elements; the root: 576 // 7 layers = 82

    def forward(self, x):
        return self.out(torch.tanh(self.moe(torch.tanh(self.inp(x)))))


def test_granularity_is_elements_per_layer_with_containers_and_torch_leaves_excluded():
    from zero_ext.zero.leaf import module_granularity

    model = Model()
    g = module_granularity(model)
    assert g[id(model.moe)] == 126 // 4 and g[id(model)] == 576 // 7
    assert g[id(model.moe.experts)] == sys.maxsize  # a ModuleList is never a leaf
    assert g[id(model.inp)] == g[id(model.moe.experts[0])] == sys.maxsize  # torch leaf modules neither


def test_outermost_qualifying_modules_are_marked():
    from zero_ext.zero import get_z3_leaf_modules
    from zero_ext.zero.leaf import set_leaf_modules_by_granularity

    model = Model()
    assert set_leaf_modules_by_granularity(model, 40) == [model.moe]
    assert get_z3_leaf_modules(model) == [model.moe]
    whole = Model()
    assert set_leaf_modules_by_granularity(whole, 82) == [whole]  # the root qualifies first: one leaf


def _config(threshold, leaf_names=()):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_module_granularity_threshold": threshold,
                                  "leaf_module": {"names": list(leaf_names)}}}


def _train(threshold, leaf_names):
    import zero_ext

    torch.manual_seed(0)
    model = Model()
    engine = zero_ext.initialize(model=model, config=_config(threshold, leaf_names))[0]
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(11)
    for _ in range(4):
        x, y = torch.randn(2 * world, 4, generator=gen), torch.randn(2 * world, 60, generator=gen)
        engine.backward((engine(x[2 * rank:2 * rank + 2]) - y[2 * rank:2 * rank + 2]).pow(2).mean())
        engine.step()
    leaves = [n for n, m in model.named_modules() if zero_ext.zero.z3_leaf_module(m)]
    with zero_ext.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return leaves, params


def test_threshold_trains_the_data_dependent_block_as_marking_it_by_hand_does():
    by_threshold = run_ranks(2, _train, 40, ())
    by_hand = run_ranks(2, _train, 0, ("moe",))
    assert [leaves for leaves, _ in by_threshold] == [["moe"], ["moe"]]
    for (_, got), (_, want) in zip(by_threshold, by_hand):
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_threshold_below_every_granularity_marks_nothing_and_says_the_smallest(caplog):
    from zero_ext.zero.leaf import set_leaf_modules_by_granularity

    with caplog.at_level(logging.WARNING, logger="zero_ext.zero"):
        assert set_leaf_modules_by_granularity(Model(), 30) == []
    assert "smallest module granularity is 31 (Experts)" in caplog.text


def test_threshold_is_a_stage_3_key():
    from zero_ext.config import ConfigWarning, load_config

    with pytest.warns(ConfigWarning, match="module_granularity_threshold"):
        load_config({"zero_optimization": {"stage": 2, "stage3_module_granularity_threshold": 40}})
