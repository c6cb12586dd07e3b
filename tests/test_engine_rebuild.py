"""A failed initialize leaves the model as it was (so initialize can be called again), and a second
initialize over a model a live engine holds hands it over: the old engine is destroyed, the new one
trains as a fresh one would."""
import os
import warnings

import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP


def _config(stage, **zero):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, **zero}}


def _losses(engine, steps=2):
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        loss = engine.module.loss(MLP.batch(2, gen))
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _reference_losses(values, stage):
    """The losses of a fresh engine over a fresh MLP holding ``values`` (name -> tensor): what a handed-over
    or rebuilt engine must reproduce."""
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(values[n])
    ref = zero_ext.initialize(model=model, config=_config(stage))[0]
    expected = _losses(ref)
    ref.destroy()
    return expected


def _hooked(model):
    return any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()) or any(
        p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


def _fail_then_retry(stage, bad, good, root):
    import zero_ext
    from zero_ext.zero import is_zero_param

    blocker = os.path.join(root, "not-a-directory")
    if torch.distributed.get_rank() == 0:
        open(blocker, "w").close()
    torch.distributed.barrier()
    nvme_path = os.path.join(blocker, "swap")  # cannot exist: its parent is a file
    torch.manual_seed(0)
    model = MLP()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    error = None
    try:
        zero_ext.initialize(model=model, config=_config(stage, **bad(nvme_path)))
    except OSError as exc:
        error = type(exc).__name__
    restored = (not any(is_zero_param(p) or hasattr(p, "ds_tensor") for p in model.parameters()),
                not _hooked(model),
                all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters()))
    engine = zero_ext.initialize(model=model, config=_config(stage, **good))[0]
    again = _losses(engine)
    engine.destroy()
    torch.manual_seed(0)
    fresh = zero_ext.initialize(model=MLP(), config=_config(stage, **good))[0]
    expected = _losses(fresh)
    fresh.destroy()
    return error, restored, again, expected


def NVME_PARAMS(path):
    return {"offload_param": {"device": "nvme", "nvme_path": path}, "offload_optimizer": {"device": "cpu"}}


def NVME_OPTIMIZER(path):
    return {"offload_optimizer": {"device": "nvme", "nvme_path": path}}


@pytest.mark.parametrize("stage,bad", [(3, NVME_PARAMS), (3, NVME_OPTIMIZER), (2, NVME_OPTIMIZER)],
                         ids=["z3-nvme-params", "z3-nvme-optimizer", "z2-nvme-optimizer"])
def test_a_failed_initialize_is_undone_and_can_be_retried(stage, bad, tmp_path):
    for error, restored, again, expected in run_ranks(2, _fail_then_retry, stage, bad,
                                                      {"offload_optimizer": {"device": "cpu"}}, str(tmp_path)):
        assert error is not None
        assert restored == (True, True, True)  # whole again, no hooks, the same values
        assert again == expected


def _second_initialize(stage):
    import zero_ext
    from zero_ext.engine import StepPhase

    torch.manual_seed(0)
    model = MLP()
    first = zero_ext.initialize(model=model, config=_config(stage))[0]
    _losses(first, 1)
    with zero_ext.zero.GatheredParameters(list(model.parameters())):
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = zero_ext.initialize(model=model, config=_config(stage))[0]
    handed_over = [str(w.message) for w in caught if "still held by another engine" in str(w.message)]
    again = _losses(second)
    second.destroy()
    expected = _reference_losses(trained, stage)  # the first engine's trained values, in a fresh engine
    return first.phase is StepPhase.DESTROYED, len(handed_over), again, expected


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_second_initialize_over_a_held_model_hands_it_over(stage):
    for old_destroyed, warned, again, expected in run_ranks(2, _second_initialize, stage):
        assert old_destroyed and warned == 1
        assert again == pytest.approx(expected, rel=1e-6)


def _mismatched(what):
    import zero_ext

    rank = torch.distributed.get_rank()
    stage = 1 + rank if what == "stage" else 2
    model = MLP(hidden=13 + rank) if what == "model" else MLP()
    try:
        zero_ext.initialize(model=model, config=_config(stage))
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("what,named", [("stage", "stage=1"), ("model", "shapes=")])
def test_ranks_with_another_config_or_model_fail_at_initialize_naming_it(what, named):
    import time

    start = time.monotonic()
    errors = run_ranks(2, _mismatched, what, timeout=60)
    assert time.monotonic() - start < 30
    for error in errors:
        assert error is not None and "zero_ext.initialize is collective and every rank must pass the same" in error
        assert named in error and "every rank must build the same model with the same config" in error


def _zero_init_model_at(stage):
    import zero_ext

    torch.manual_seed(0)
    with zero_ext.zero.Init():  # partitioned, although the engine below keeps whole parameters
        model = MLP()
    with zero_ext.zero.GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zero_ext.initialize(model=model, config=_config(stage))[0]
    warned = [str(w.message) for w in caught if "partitioned by zero.Init" in str(w.message)]
    whole = all(not hasattr(p, "ds_id") and torch.equal(p.detach(), values[n]) for n, p in model.named_parameters())
    got = _losses(engine)
    engine.destroy()
    return warned, whole, got, _reference_losses(values, stage)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_zero_init_model_under_a_stage_below_3_is_made_whole_and_trains(stage):
    for warned, whole, got, expected in run_ranks(2, _zero_init_model_at, stage):
        assert len(warned) == 1 and f"ZeRO stage {stage}" in warned[0]
        assert whole and got == expected
