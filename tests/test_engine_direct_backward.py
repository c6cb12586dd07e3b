"""loss.backward() called directly on the engine's output, and engine.scale(loss)
(zero_ext/optim/direct_backward.py): the same parameters as engine.backward(loss) at every stage, with
gradient accumulation and for a non-scalar backward; fp16 needs engine.scale; torch.func transforms and
losses not computed through the engine's forward are left alone."""
import pytest
import torch

from helpers.harness import RankFailed, run_ranks
from helpers.models import MLP


def _config(stage, gas, fp16=False):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _train(stage, gas, how, fp16=False):
    import zero_ext

    torch.manual_seed(0)
    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(stage, gas, fp16))
    dtype = torch.float16 if fp16 else torch.float32
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(2 * gas):
        x, y = MLP.batch(2, gen, dtype)
        out = engine(x)
        loss = (out.float() - y.float()).pow(2).mean()
        if how == "engine":
            engine.backward(loss)
        elif how == "direct":
            loss.backward()
        elif how == "scaled":
            engine.scale(loss).backward()
        else:  # non-scalar: the output's own gradient
            out.backward(2 * (out - y) / out.numel())
        engine.step()
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    steps = engine.global_steps
    engine.destroy()
    return params, steps


def _compare(stage, gas, how, fp16=False):
    ref, ref_steps = _train(stage, gas, "engine", fp16)
    got, steps = _train(stage, gas, how, fp16)
    return max((ref[n] - got[n]).abs().max().item() for n in ref), steps == ref_steps == 2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("gas", [1, 2])
def test_direct_backward_matches_engine_backward(stage, gas):
    for diff, steps_ok in run_ranks(2, _compare, stage, gas, "direct"):
        assert diff < 1e-6 and steps_ok


@pytest.mark.parametrize("stage", [1, 3])
def test_non_scalar_backward_and_fp16_scale(stage):
    for diff, steps_ok in run_ranks(2, _compare, stage, 2, "nonscalar"):
        assert diff < 1e-6 and steps_ok
    for diff, steps_ok in run_ranks(2, _compare, stage, 1, "scaled", True):
        assert diff < 1e-3 and steps_ok  # (fp16 parameters)


def _fp16_unscaled(stage):
    import zero_ext

    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(stage, 1, fp16=True))
    x, y = MLP.batch(2, torch.Generator().manual_seed(0), torch.float16)
    (engine(x) - y).pow(2).float().mean().backward()


def test_fp16_direct_backward_without_scale_is_refused():
    with pytest.raises(RankFailed, match=r"engine.scale\(loss\).backward\(\)"):
        run_ranks(1, _fp16_unscaled, 2)


def _torch_func_and_scale_errors():
    import zero_ext

    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(1, 1))
    x, y = MLP.batch(2, torch.Generator().manual_seed(0))
    params = dict(engine.module.named_parameters())
    grads = torch.func.grad(lambda p: torch.func.functional_call(engine, p, (x,)).pow(2).mean())(params)
    errors = []
    for bad in (torch.ones(2, requires_grad=True) * 2, torch.tensor(1.0)):
        try:
            engine.scale(bad)
        except AssertionError as exc:
            errors.append(str(exc))
    return engine.phase.value, len(grads), errors


def test_torch_func_is_not_counted_and_scale_checks_the_loss():
    phase, n, errors = run_ranks(1, _torch_func_and_scale_errors)[0]
    assert phase == "idle" and n == 6  # (frozen parameters too: functional_call differentiates them all)
    assert len(errors) == 2 and all("scalar tensor with a grad_fn" in e for e in errors)


def _two_engines_one_loss(stage, shared):
    """Two engines, one combined loss through engine.module (DeepSpeed's test_multiple_models): a
    loss.backward() then engine._backward_epilogue() on each, against each engine's own engine.backward."""
    import zero_ext

    engines = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        engines.append(zero_ext.initialize(model=MLP(), config=_config(stage, 1))[0])
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(2):
        x, y = MLP.batch(2, gen, torch.float32)
        losses = [(e.module(x) - y).pow(2).mean() / (i + 1) for i, e in enumerate(engines)]
        if shared:
            sum(losses).backward()
            for e in engines:
                e._backward_epilogue()
        else:
            for e, loss in zip(engines, losses):
                e.backward(loss)
        for e in engines:
            e.step()
    params = []
    for e in engines:
        with zero_ext.zero.GatheredParameters(list(e.module.parameters())):
            params.append({n: p.detach().clone() for n, p in e.module.named_parameters()})
        assert e.global_steps == 2
        e.destroy()
    return params


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backward_epilogue_counts_a_shared_loss_backward(stage):
    want = run_ranks(2, _two_engines_one_loss, stage, False)
    got = run_ranks(2, _two_engines_one_loss, stage, True)
    for ref_rank, got_rank in zip(want, got):
        for ref, params in zip(ref_rank, got_rank):
            assert max((ref[n] - params[n]).abs().max().item() for n in ref) < 1e-6


def _fp16_epilogue_unscaled():
    import zero_ext

    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(2, 1, fp16=True))
    x, y = MLP.batch(2, torch.Generator().manual_seed(0), torch.float16)
    (engine.module(x) - y).pow(2).float().mean().backward()
    with pytest.warns(RuntimeWarning, match=r"unscaled loss .*divides these gradients by the loss scale \(256\)"):
        engine._backward_epilogue()
    engine.step()  # runs, as in DeepSpeed
    return engine.global_steps


def test_backward_epilogue_on_an_unscaled_fp16_loss_warns():
    assert run_ranks(1, _fp16_epilogue_unscaled) == [1]


def _hand_set_gradients(stage):
    """Two steps whose gradients the script assigns to .grad (no backward), each rank its own."""
    import zero_ext

    torch.manual_seed(0)
    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(stage, 1))
    rank = torch.distributed.get_rank()
    for step in range(2):
        for i, p in enumerate(p for p in engine.module.parameters() if p.requires_grad):
            p.grad = torch.full_like(p, 0.1 * (i + 1) * (rank + 1) * (step + 1))
        engine.step()
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()], engine.global_steps


def _hand_set_reference(world):
    torch.manual_seed(0)
    model = MLP()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-2)
    for step in range(2):
        for i, p in enumerate(params):  # the mean of what the ranks assigned
            p.grad = torch.full_like(p, 0.1 * (i + 1) * (step + 1) * sum(r + 1 for r in range(world)) / world)
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # (gradient_clipping's default)
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1])
def test_gradients_assigned_by_hand_are_averaged_and_applied_at_stages_0_and_1(stage):
    want = _hand_set_reference(2)
    for params, steps in run_ranks(2, _hand_set_gradients, stage):
        assert steps == 2
        assert max((a - b).abs().max().item() for a, b in zip(params, want)) < 1e-6


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_assigned_by_hand_at_stages_2_and_3_are_refused(stage):
    with pytest.raises(RankFailed, match=r"assigned by hand, but ZeRO stage \d reduces gradients during "
                                         r"engine.backward\(\).*use ZeRO stage 0 or 1"):
        run_ranks(2, _hand_set_gradients, stage)
