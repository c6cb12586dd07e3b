"""The engine's API surface and its errors for bad input (single process unless stated)."""
import argparse
import json
import warnings

import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _engine(config=None, **kwargs):
    import zero_ext

    torch.manual_seed(0)
    model = kwargs.pop("model", None) or MLP()
    return zero_ext.initialize(model=model, config=config or BASE, **kwargs)


def _train_step(engine, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    loss = engine.module.loss(MLP.batch(2, gen))
    engine.backward(loss)
    engine.step()
    return loss


def _api_checks():
    import zero_ext

    config = {**BASE, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}
    engine, opt, loader, sched = _engine(config)
    world = torch.distributed.get_world_size()
    out = {"batch": engine.get_batch_info(), "stage": engine.zero_optimization_stage(),
           "lr": engine.get_lr(), "mom": engine.get_mom(), "isengine": isinstance(engine, zero_ext.DeepSpeedEngine),
           "forwarded": engine.head is engine.module.head, "loader": loader, "sched": sched}
    gen = torch.Generator().manual_seed(0)
    applied, boundaries = [], []
    for _ in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        _train_step(engine, gen)
        applied.append(engine.was_step_applied())
    out.update(applied=applied, boundaries=boundaries, steps=(engine.global_steps, engine.micro_steps,
                                                               engine.global_samples),
               norm=engine.get_global_grad_norm(), world=world, state_keys=sorted(opt.state_dict()["state"]))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_counters_accessors_and_accumulation_boundaries(world):
    out = run_ranks(world, _api_checks)[0]
    assert out["batch"] == (2 * 2 * world, 2, 2)
    assert out["stage"] == 1 and out["isengine"] and out["forwarded"]
    assert out["lr"] == [1e-2] and out["mom"] == [(0.9, 0.999)]
    assert out["loader"] is None and out["sched"] is None
    assert out["boundaries"] == [False, True, False, True]
    assert out["applied"] == [False, True, False, True]
    assert out["steps"] == (2, 4, 2 * 4 * world)
    assert out["norm"] is not None and out["norm"] > 0
    assert out["state_keys"] == [0]  # one flat fp32 partition per param group: one state entry


def _seeded_differently():
    import zero_ext

    torch.manual_seed(torch.distributed.get_rank())  # scripts often seed per rank
    model = MLP()
    zero_ext.initialize(model=model, config=BASE)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_parameters_are_broadcast_from_rank_0():
    a, b = run_ranks(2, _seeded_differently)
    assert all(torch.equal(a[n], b[n]) for n in a)


def _loader_batches():
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.arange(16.0).unsqueeze(1))
    engine, _, loader, _ = _engine(training_data=data)
    return [b[0].flatten().tolist() for b in loader]


def test_training_data_gives_a_distributed_loader_with_the_micro_batch():
    r0, r1 = run_ranks(2, _loader_batches)
    assert all(len(b) == 2 for b in r0 + r1)
    seen = sorted(x for b in r0 + r1 for x in b)
    assert seen == list(map(float, range(16)))  # each sample once, split over the ranks


def test_client_optimizer_instance_and_callable_and_args_config(tmp_path):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"train_micro_batch_size_per_gpu": 2}
    engine, zopt, _, _ = zero_ext.initialize(model=model, optimizer=opt, config=config)
    assert zopt is opt and engine.get_lr() == [0.1]  # stage 0 over fp32: the client's own, as DeepSpeed
    _train_step(engine)

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    args = argparse.Namespace(deepspeed_config=str(path))
    engine, zopt, _, sched = zero_ext.initialize(
        args=args, model=MLP(), optimizer=lambda ps: torch.optim.Adam(ps, lr=3e-3),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    assert isinstance(zopt, torch.optim.Adam) and engine.get_lr() == [3e-3]
    _train_step(engine)
    assert engine.get_lr() == [1.5e-3]  # the scheduler stepped with the optimizer


def test_config_weight_decay_defaults_to_deepspeeds_zero():
    engine, opt, _, _ = _engine()
    assert opt.param_groups[0]["weight_decay"] == 0.0


def test_step_before_backward_warns_and_updates_nothing():
    engine, _, _, _ = _engine()
    before = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.warns(RuntimeWarning, match=r"step\(\) was called before engine.backward\(\)"):
        engine.step()
    assert not engine.was_step_applied() and engine.global_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_no_model():
    import zero_ext

    with pytest.raises(ValueError, match="model is required"):
        zero_ext.initialize(config=BASE)


def test_duplicate_tensor_in_model_parameters():
    model = MLP()
    groups = [{"params": [model.body.weight]}, {"params": [model.head.weight, model.body.weight]}]
    with pytest.raises(ValueError, match=r"parameter 'body.weight' appears twice in model_parameters"):
        _engine(model=model, model_parameters=groups)


def test_tensor_that_is_not_a_parameter():
    with pytest.raises(ValueError, match="not a parameter of the model"):
        _engine(model_parameters=[torch.nn.Parameter(torch.zeros(3))])


@pytest.mark.parametrize("as_callable", [False, True])
def test_optimizer_argument_wins_over_the_config_section_with_a_warning(as_callable):
    # as in DeepSpeed: the client's optimizer is stepped; the config's AdamW is never built
    model = MLP()
    client = (lambda groups: torch.optim.SGD(groups, lr=0.1)) if as_callable else \
        torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="the passed optimizer is used and the section is ignored"):
        engine, opt, _, _ = _engine({**BASE, "zero_allow_untested_optimizer": True}, model=model, optimizer=client)
    assert type(opt) is torch.optim.SGD and engine.get_lr() == [0.1]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_step(engine)
    grads_free = all("exp_avg" not in s for s in opt.state.values())
    assert grads_free and any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_no_optimizer_at_all_gives_a_forward_only_engine():
    engine, opt, _, _ = _engine({"train_micro_batch_size_per_gpu": 2})
    assert opt is None and engine.get_lr() == []
    with pytest.raises(RuntimeError, match="has no optimizer"):
        engine.step()


def test_module_without_trainable_parameters():
    model = MLP().requires_grad_(False)
    with pytest.raises(ValueError, match="the model has no trainable parameters"):
        _engine(model=model)


def _contradicting_batch():
    _engine({**BASE, "train_batch_size": 6, "gradient_accumulation_steps": 1})


def test_batch_triple_that_contradicts_the_world_size():
    from helpers.harness import RankFailed

    with pytest.raises(RankFailed, match=r"train_batch_size.*6"):
        run_ranks(2, _contradicting_batch)


def test_unimplemented_feature_is_refused_by_name():
    from zero_ext.config import ConfigError

    with pytest.raises(ConfigError, match="zero_optimization.zeropp_loco_param"):
        _engine({**BASE, "zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}})


def test_backward_of_a_non_scalar_or_detached_loss():
    engine, _, _, _ = _engine()
    out = engine(MLP.batch(2, torch.Generator().manual_seed(0))[0])
    with pytest.raises(TypeError, match="expects the scalar loss tensor"):
        engine.backward(out)
    with pytest.raises(RuntimeError, match="does not require grad"):
        engine.backward(out.sum().detach())


def _unused_parameter(ignore):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {**BASE, "zero_optimization": {"stage": 2, "ignore_unused_parameters": ignore}}
    engine, _, _, _ = zero_ext.initialize(model=model, config=config)
    x, y = MLP.batch(2, torch.Generator().manual_seed(0))
    head_only = engine.module.head(torch.tanh(torch.ones(2, 13)))  # body never used
    engine.backward((head_only - y).pow(2).mean())
    engine.step()
    return engine.global_steps


def test_unused_parameters_are_allowed_by_default_and_refused_on_request():
    from helpers.harness import RankFailed

    assert run_ranks(2, _unused_parameter, True) == [1, 1]
    with pytest.raises(RankFailed, match="received no gradient in this backward pass"):
        run_ranks(2, _unused_parameter, False)


def test_user_zero_grad_between_micro_steps_is_tolerated():
    config = {**BASE, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}
    engine, _, _, _ = _engine(config)
    gen = torch.Generator().manual_seed(0)
    _train_step(engine, gen)
    engine.module.zero_grad()  # sets .grad to None behind the engine's back
    loss = engine.module.loss(MLP.batch(2, gen))
    engine.backward(loss)
    engine.step()
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0
    # after the step .grad is None, as DeepSpeed's optimizers leave it; the next backward fills it again
    assert all(p.grad is None for p in engine.module.parameters() if p.requires_grad)
    engine.backward(engine.module.loss(MLP.batch(2, gen)))
    assert all(p.grad is not None for p in engine.module.parameters() if p.requires_grad)


def test_grad_accum_dtype_other_than_what_the_stage_does_is_refused():
    from zero_ext.config import ConfigError

    # (bf16 at stage 1 accumulates in fp32 when asked: test_engine_config_features.py)
    config = {**BASE, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
              "zero_optimization": {"stage": 0}}
    with pytest.raises(ConfigError, match=r"grad_accum_dtype = 'fp32'.*accumulates gradients in bf16.*stage 2"):
        _engine(config)
    with pytest.raises(NotImplementedError):  # what DeepSpeed raises for a combination it lacks
        _engine(config)


@pytest.mark.parametrize("stage, precision, want, actual", [(2, "bf16", "bf16", "fp32"), (3, "fp32", "fp16", "fp32"),
                                                            (1, "fp32", "bf16", "fp32")])
def test_grad_accum_dtype_the_stage_lacks_is_ignored_with_a_warning_at_stages_1_to_3(stage, precision, want, actual):
    # DeepSpeed's ZeRO optimizers accept data_types.grad_accum_dtype and ignore it (test_multiple_models relies on it)
    config = {**BASE, "data_types": {"grad_accum_dtype": want}, "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    with pytest.warns(UserWarning, match=rf"grad_accum_dtype = '{want}' is ignored: ZeRO stage {stage} .*in {actual}"):
        engine, *_ = _engine(config)
    x = torch.randn(2, 7, dtype=next(engine.module.parameters()).dtype)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    assert engine.global_steps == 1


def _bucket_dtype_and_bytes():
    config = {**BASE, "bf16": {"enabled": True}, "communication_data_type": "fp32",
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 50}}
    engine, opt, _, _ = _engine(config)
    loss = engine.module.loss(MLP.batch(2, torch.Generator().manual_seed(0), torch.bfloat16))
    engine.backward(loss)
    from zero_ext.comm import native

    buckets = engine.memory_breakdown()["comm_buffers"]["accelerator"] - native.buffer_bytes()
    return opt.reducer.buffers[0].dtype, buckets, opt.reducer.buffer_numel


def test_communication_data_type_sets_the_bucket_dtype():
    # two ranks: with one there is nothing to reduce and no bucket (gradients go straight to the partition)
    for dtype, nbytes, numel in run_ranks(2, _bucket_dtype_and_bytes):
        assert dtype == torch.float32 and nbytes == 4 * numel


def test_config_scheduler_steps_with_applied_steps_only():
    config = {**BASE, "fp16": {"enabled": True, "initial_scale_power": 4},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 10, "warmup_type": "linear"}}}
    engine, _, _, sched = _engine(config)
    gen = torch.Generator().manual_seed(0)
    lrs = [engine.get_lr()[0]]
    for step in range(4):
        loss = engine.module.loss(MLP.batch(2, gen, torch.float16))
        engine.backward(loss * (float("inf") if step == 2 else 1.0))
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert type(sched).__name__ == "WarmupLR"
    assert engine.skipped_steps == 1
    assert lrs[3] == lrs[2] and lrs[1] < lrs[2] < lrs[4]  # no scheduler step on the skipped step
    # DeepSpeed's WarmupLR: the first step() is iteration 0 (warmup_min_lr), so three applied steps
    # reach iteration 2 of the 10-step linear warm-up
    assert lrs[4] == pytest.approx(0.01 * 2 / 10)


def _train_lion(stage):
    import zero_ext

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage}}
    engine = zero_ext.initialize(model=MLP(), config=cfg)[0]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x, y = MLP.batch(2 * world, gen)
        engine.backward(engine.module.loss((x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])))
        engine.step()
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        return type(engine.zero_optimizer.optimizer).__name__, {n: p.detach().clone()
                                                             for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("stage", [1, 3])
def test_lion_from_the_config_runs_the_c_optimizer_and_matches_it_unpartitioned(stage):
    from zero_ext.ops import CPULion

    name, params = run_ranks(2, _train_lion, stage)[0]
    torch.manual_seed(0)
    ref = MLP()
    opt = CPULion([p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x, y = MLP.batch(4, gen)
        for r in range(2):
            (ref.loss((x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])) / 2).backward()
        opt.step()
        opt.zero_grad()
    assert name == "CPULion"
    for n, p in ref.named_parameters():
        assert ((params[n] - p.detach()).abs() <= 1e-5 * (p.detach().abs() + 1e-3)).all(), n


def test_compute_device_follows_the_visible_gpus(monkeypatch):
    """cuda:LOCAL_RANK when each rank sees every GPU; cuda:0 when CUDA_VISIBLE_DEVICES gives each rank
    its own; a LOCAL_RANK past several visible GPUs named (the CUDA calls themselves need a GPU, so
    torch.cuda's answers are stood in for here)."""
    from zero_ext.accelerator import compute_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for count, local, want in ((8, 3, "cuda:3"), (1, 3, "cuda:0"), (1, 0, "cuda:0")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda c=count: c)
        monkeypatch.setenv("LOCAL_RANK", str(local))
        assert str(compute_device()) == want
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3, but this process sees 2 GPUs"):
        compute_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert str(compute_device()) == "cpu"
