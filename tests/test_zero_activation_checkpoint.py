"""Activation checkpointing (torch.utils.checkpoint, reentrant and not) under the ZeRO-3 hooks: the
recomputation inside backward gathers the parameters again, and gradients equal a plain model's."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers.harness import run_ranks
from helpers.zero3 import Block, grads, rank, same_tensors


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Linear(5, 6)
        self.blocks = nn.ModuleList([Block(6) for _ in range(3)])
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _checkpointing(reentrant):
    import zero_ext.zero as zero

    torch.manual_seed(5)
    ref = Checkpointed(reentrant)
    torch.manual_seed(5)
    with zero.Init():
        model = Checkpointed(reentrant)
    zm = zero.ZeroModel(model, param_persistence_threshold=0)
    seen = []  # what each block's first linear saw: (grad enabled, its weight's shape)
    def record(module, args):
        seen.append((torch.is_grad_enabled(), tuple(module.weight.shape)))

    for block in model.blocks:
        block.fc1.register_forward_pre_hook(record)
    gen = torch.Generator().manual_seed(rank())
    losses = []
    for _ in range(2):
        x = torch.randn(4, 5, generator=gen)
        a, b = ref(x).pow(2).mean(), model(x).pow(2).mean()
        losses.append(torch.equal(a, b))
        a.backward()
        b.backward()
    held = [zp.name for zp in zm.params if zp.holders or zp.param.numel()]
    zm.destroy()
    return losses, same_tensors(grads(ref), grads(model)), held, seen


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_blocks_regather_for_recomputation(reentrant):
    for losses, grads_differ, held, seen in run_ranks(2, _checkpointing, reentrant):
        assert all(losses) and grads_differ == [] and held == []
        # each block runs twice per step (forward, recomputation in backward), gathered both times
        assert len(seen) == 2 * 2 * 3 and all(shape == (13, 6) for _, shape in seen)
        if reentrant:  # the first pass runs under no_grad, the recomputation with grad
            assert [g for g, _ in seen[:3]] == [False] * 3 and [g for g, _ in seen[3:6]] == [True] * 3
