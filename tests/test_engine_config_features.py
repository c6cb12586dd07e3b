"""Config features that change what the engine does, each against a plain single-process reference:
gradient_allreduce_op "sum", a client optimizer next to a config optimizer section, elastic_checkpoint
(accepted, deprecated), bf16 with data_types.grad_accum_dtype fp32 at ZeRO-1.

Tolerances (../shared/TESTING.md): fp32 at N ranks |dp| <= 1e-5 (|p| + lr); bf16 as stated at its test.
"""
import copy
import warnings

import pytest
import torch

from helpers.engine import full_params
from helpers.harness import run_ranks
from helpers.models import MLP

LR = 0.05
STEPS = 3


def _batches(world, steps=STEPS, micro=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[MLP.batch(micro, gen) for _ in range(world)] for _ in range(steps)]


def _close(got, want, lr=LR):
    return all(((got[n] - want[n]).abs() <= 1e-5 * (want[n].abs() + lr)).all() for n in want)


# -- gradient_allreduce_op "sum" --------------------------------------------------------------------------


def _sum_run(stage, op):
    import zero_ext

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "gradient_allreduce_op": op,
              "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}}
    engine, *_ = zero_ext.initialize(model=model, config=config)
    for step in _batches(world):
        engine.backward(engine.module.loss(step[rank]))
        engine.step()
    return full_params(engine)


def _sgd_reference(world, summed):
    """Plain SGD on one process: the ranks' mean losses added up ("sum") or averaged ("mean")."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in _batches(world):
        loss = sum(model.loss(b) for b in step)
        (loss if summed else loss / world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_sum_adds_the_ranks_gradients(stage):
    got = run_ranks(2, _sum_run, stage, "sum")[0]
    assert _close(got, _sgd_reference(2, summed=True))
    assert not _close(got, _sgd_reference(2, summed=False))  # (the test can tell sum from mean)


def test_mean_is_still_the_default_average():
    assert _close(run_ranks(2, _sum_run, 2, "mean")[0], _sgd_reference(2, summed=False))


def test_sum_is_refused_at_stage_3_before_anything_is_built():
    import zero_ext
    from zero_ext.config import ConfigError

    with pytest.raises(ConfigError, match="not supported with ZeRO stage 3"):
        zero_ext.initialize(model=MLP(), config={"train_batch_size": 2, "gradient_allreduce_op": "sum",
                                                 "zero_optimization": {"stage": 3}})
