"""DeepSpeed engine and parameter calls that its unit tests and hand-written training loops make, on real
engines (2 gloo ranks):

- engine.allreduce_gradients(): averages this step's gradients now, at the accumulation boundary only
  (before it, stages 0/1 have nothing reduced yet and it does nothing);
- param.ds_summary() on a ZeRO-3 parameter (gone once the parameter is made whole again);
- optimizer._global_grad_norm: DeepSpeed's name of the last step's gradient norm;
- optimizer._get_norm_groups(): each flat group's gradient norm over the ranks, following safe_set_* changes.
"""
import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP


def _engine(stage, gas):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, opt, *_ = zero_ext.initialize(model=model, config=config)
    return engine, opt, model


def _allreduce(stage):
    from zero_ext.config.errors import EngineUsageError

    engine, opt, model = _engine(stage, gas=2)
    gen = torch.Generator().manual_seed(10 + torch.distributed.get_rank())
    engine.backward(model.loss(MLP.batch(2, gen)))
    engine.allreduce_gradients()  # not the boundary: nothing happens, the micro step goes on
    early = opt.reduced
    engine.step()
    engine.backward(model.loss(MLP.batch(2, gen)))
    engine.allreduce_gradients()
    at_boundary = opt.reduced
    pieces = [v.clone() for vs in opt.averaged_gradients.values() for v in vs]
    refused = None
    try:  # stages 0/1: reduced early, so no further backward before the step
        engine.backward(model.loss(MLP.batch(2, gen)))
    except EngineUsageError as exc:
        refused = str(exc)
    engine.step()
    norm = (opt._global_grad_norm, opt.global_grad_norm)
    engine.destroy()
    return early, at_boundary, pieces, refused, norm


@pytest.mark.parametrize("stage", [1, 3])
def test_allreduce_gradients_reduces_at_the_boundary_only(stage):
    results = run_ranks(2, _allreduce, stage)
    for early, at_boundary, pieces, refused, (ds_norm, norm) in results:
        assert (early, at_boundary) == (False, True)
        assert all(torch.isfinite(p).all() for p in pieces) and any(p.abs().sum() > 0 for p in pieces)
        assert (refused is not None) == (stage == 1)
        assert ds_norm == norm and norm is not None and norm > 0


def _summary():
    import zero_ext.zero as zero

    with zero.Init():
        layer = torch.nn.Linear(3, 5)
    summary = layer.weight.ds_summary()
    zero.unpartition(layer)
    return summary, hasattr(layer.weight, "ds_summary")


def test_ds_summary_describes_a_partitioned_parameter():
    for summary, left in run_ranks(2, _summary):
        assert (summary["status"], summary["ds_shape"], summary["ds_numel"]) == ("NOT_AVAILABLE", (5, 3), 15)
        assert summary["ds_tensor.shape"] == (8,) and summary["numel"] == 0
        assert not left


def _norm_groups(stage):
    from zero_ext.utils import safe_get_full_grad, safe_get_local_grad, safe_set_local_grad

    engine, opt, model = _engine(stage, gas=1)
    engine.backward(model.loss(MLP.batch(2, torch.Generator().manual_seed(10 + torch.distributed.get_rank()))))
    params = [p for g in opt.flat_groups for p in g.params]
    want = torch.stack([safe_get_full_grad(p).double().norm() for p in params]).norm().item()
    got = torch.stack(opt._get_norm_groups()).norm().item()
    first = params[0]
    safe_set_local_grad(first, torch.zeros_like(safe_get_local_grad(first)))  # (each rank its fragment)
    rest = torch.stack([safe_get_full_grad(p).double().norm() for p in params[1:]]).norm().item()
    after = torch.stack(opt._get_norm_groups()).norm().item()
    engine.destroy()
    return len(opt.flat_groups), want, got, rest, after


@pytest.mark.parametrize("stage", [2, 3])
def test_norm_groups_combine_to_the_global_gradient_norm(stage):
    for groups, want, got, rest, after in run_ranks(2, _norm_groups, stage):
        assert groups >= 1 and want > rest > 0
        assert abs(got - want) <= 1e-5 * want and abs(after - rest) <= 1e-5 * want
