"""Views a user takes of a gathered ZeRO-3 parameter (``p.detach().numpy()`` to log weights) do not break
the parameter's release or the training that follows."""
import torch

from helpers.harness import run_ranks
from helpers.models import MLP


def _numpy_inside_gathered():
    import numpy as np

    import zero_ext

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = zero_ext.initialize(model=MLP(), config=config)[0]
    gen = torch.Generator().manual_seed(1)
    losses, logged = [], []
    for _ in range(3):
        with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
            arrays = [p.detach().numpy() for p in engine.module.parameters()]  # how people log weights
            logged.append(float(sum(np.abs(a).sum() for a in arrays)))
        loss = engine.module.loss(MLP.batch(2, gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    kept = float(sum(np.abs(a).sum() for a in arrays))  # the arrays stay readable after the block
    engine.destroy()
    torch.manual_seed(0)
    ref = zero_ext.initialize(model=MLP(), config=config)[0]
    gen = torch.Generator().manual_seed(1)
    expected = []
    for _ in range(3):
        loss = ref.module.loss(MLP.batch(2, gen))
        ref.backward(loss)
        ref.step()
        expected.append(loss.item())
    ref.destroy()
    return losses, expected, logged[-1] == kept


def test_numpy_views_taken_inside_gathered_parameters_do_not_break_the_next_step():
    for losses, expected, kept in run_ranks(2, _numpy_inside_gathered):
        assert losses == expected and kept
