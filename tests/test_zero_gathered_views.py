"""Tensors kept from inside GatheredParameters (or zero.Init) outlive the block with their values.

On the CPU ``p.detach().cpu()`` is the gathered storage itself, and ``p.detach().numpy()`` and
``p.data[0]`` view it too. Partitioning must leave such storage to the views instead of freeing it
under them (a read would then touch freed memory, and can segfault), and the training that follows
must be unaffected. Checked at stage 3 and stage 3 with offload_param cpu.
"""
import pytest
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.models import MLP


def _config(offload):
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": zero}


def _train(engine, steps, gen):
    losses = []
    for _ in range(steps):
        loss = engine.module.loss(MLP.batch(2, gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _views_kept(offload):
    import zero_ext

    torch.manual_seed(0)
    engine = zero_ext.initialize(model=MLP(), config=_config(offload))[0]
    gen = torch.Generator().manual_seed(1)
    losses = _train(engine, 1, gen)
    params = list(engine.module.parameters())
    with zero_ext.zero.GatheredParameters(params):
        kept = [(p.detach().cpu(), p.data.view(-1)[1:]) for p in params]
        # (a numpy array makes its storage one torch cannot resize: only the first parameter's)
        array = params[0].detach().numpy()
        values = [p.detach().clone() for p in params]
    # after the block: each view still owns storage big enough for what it shows, with the values
    sized = all(t.untyped_storage().nbytes() >= t.numel() * t.element_size() for views in kept for t in views)
    read = all(torch.equal(cpu, v) and torch.equal(flat, v.view(-1)[1:]) for (cpu, flat), v in zip(kept, values))
    read = read and torch.equal(torch.from_numpy(array.copy()), values[0])
    losses += _train(engine, 2, gen)  # gathers allocate anew; training is unaffected
    unchanged = all(torch.equal(cpu, v) for (cpu, _), v in zip(kept, values))
    engine.destroy()

    torch.manual_seed(0)
    reference = zero_ext.initialize(model=MLP(), config=_config(offload))[0]
    expected = _train(reference, 3, torch.Generator().manual_seed(1))
    reference.destroy()
    return sized, read, unchanged, losses, expected


@pytest.mark.parametrize("offload", [False, True], ids=["stage3", "stage3-offload_param-cpu"])
def test_views_kept_from_gathered_parameters_keep_their_values(offload):
    for sized, read, unchanged, losses, expected in run_ranks(2, _views_kept, offload):
        assert sized and read and unchanged
        assert losses == expected


def _view_kept_from_init():
    import zero_ext.zero as zero

    torch.manual_seed(3)
    with zero.Init():
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh())
        nn.init.orthogonal_(model[0].weight)
        kept = model[0].weight.data  # materialised: a view of the full value
        value = kept.clone()
        torch.zeros(1)  # a later torch call: the parameter stays whole while viewed
        viewed_whole = model[0].weight.ds_status.name
    after = (kept.untyped_storage().nbytes() >= kept.numel() * 4, torch.equal(kept, value),
             model[0].weight.ds_status.name)
    with zero.GatheredParameters(list(model.parameters())):
        same = torch.equal(model[0].weight, value)
    return viewed_whole, after, same


def test_a_view_kept_from_init_keeps_the_parameter_whole_until_exit():
    for viewed_whole, after, same in run_ranks(2, _view_kept_from_init):
        assert viewed_whole == "AVAILABLE"
        assert after == (True, True, "NOT_AVAILABLE") and same
