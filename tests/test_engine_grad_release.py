"""Stages 0/1 after a step: every parameter's ``.grad`` is None (as DeepSpeed's optimizers and torch's
``zero_grad`` leave it), the next backward accumulates into the flat gradient buffer again in place
(``.grad`` is its view, no second copy), a ``.grad`` assigned by hand in between is the next step's
gradient, and the training matches a plain PyTorch reference."""
import pytest
import torch

import zero_ext
from helpers.harness import run_ranks
from helpers.models import MLP


def _views(opt):
    """Whether each parameter's .grad is its slice of its group's flat lp_grad buffer."""
    return all(p.grad is not None and p.grad.data_ptr() == g.lp_grad[off:].data_ptr()
               for g in opt.flat_groups for p, off in zip(g.params, g.offsets))


def _run(stage):
    torch.manual_seed(0)
    model = MLP()
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    trained = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.0)  # (DeepSpeed's default decay: 0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}}
    engine, opt, *_ = zero_ext.initialize(model=model, config=config)
    world, rank = engine.world_size, engine.global_rank
    log = []
    for it in range(3):
        x, y = MLP.batch(2 * world, torch.Generator().manual_seed(it))
        engine.backward(model.loss((x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])))
        log.append(_views(engine.zero_optimizer))
        engine.step()
        log.append(all(p.grad is None for p in model.parameters()))
        ref_opt.zero_grad()
        ref.loss((x, y)).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)  # (gradient_clipping's default)
        ref_opt.step()
    # a gradient assigned by hand after a step is the next step's (averaged over the ranks: the same here)
    hand = {n: torch.full_like(p, 0.05) for n, p in model.named_parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if n in hand:
            p.grad = hand[n].clone()
    engine.step()
    for n, p in ref.named_parameters():
        if n in hand:
            p.grad = hand[n].clone()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    ref_opt.step()
    gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    engine.destroy()
    return log, gap


@pytest.mark.parametrize("stage,world", [(0, 1), (1, 2)])
def test_grad_is_none_after_step_and_views_come_back(stage, world):
    for log, gap in run_ranks(world, _run, stage):
        assert log == [True, True] * 3
        assert gap < 1e-6
