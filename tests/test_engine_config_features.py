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


def _sum_run(stage, op, **extra):
    import zero_ext

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "gradient_allreduce_op": op,
              "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}, **extra}
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


@pytest.mark.parametrize("stage, scaling", [(0, {"gradient_predivide_factor": 2.0}), (1, {"prescale_gradients": True})])
def test_sum_ignores_the_mean_scaling_keys_with_a_warning(stage, scaling):
    """A config written for "mean" keeps its prescale / predivide keys when switched to "sum": they load
    (as in DeepSpeed), are named in a warning, and change nothing: the gradients are still added up."""
    from zero_ext.config import load_config

    with pytest.warns(UserWarning, match=f'{next(iter(scaling))} = .* has no effect with gradient_allreduce_op "sum"'):
        load_config({"train_batch_size": 2, "gradient_allreduce_op": "sum", **scaling})
    got = run_ranks(2, _sum_run, stage, "sum", **scaling)[0]
    assert _close(got, _sgd_reference(2, summed=True))


def test_mean_is_still_the_default_average():
    assert _close(run_ranks(2, _sum_run, 2, "mean")[0], _sgd_reference(2, summed=False))


def test_sum_is_refused_at_stage_3_before_anything_is_built():
    import zero_ext
    from zero_ext.config import ConfigError

    with pytest.raises(ConfigError, match="not supported with ZeRO stage 3"):
        zero_ext.initialize(model=MLP(), config={"train_batch_size": 2, "gradient_allreduce_op": "sum",
                                                 "zero_optimization": {"stage": 3}})


# -- DeepSpeed's exception types --------------------------------------------------------------------------
# Where DeepSpeed raises AssertionError or ZeRORuntimeException, ours derive from them (and still from what
# zero_ext raised before), keeping zero_ext's messages.


def _config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, **extra}


def test_initialize_without_a_model_is_an_assertion_error():
    import zero_ext

    with pytest.raises(AssertionError, match="model is required"):
        zero_ext.initialize(model=None, config=_config())


def test_untested_zero_optimizer_is_an_assertion_error():
    import zero_ext

    model = MLP()
    with pytest.raises(AssertionError, match="untested ZeRO optimizer") as info:
        zero_ext.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            config=_config(zero_optimization={"stage": 2}))
    assert isinstance(info.value, ValueError)


def test_client_optimizer_with_offload_is_a_zero_runtime_exception():
    import zero_ext
    from zero_ext.runtime.zero.utils import ZeRORuntimeException

    model = MLP()
    config = _config(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}})
    with pytest.raises(ZeRORuntimeException, match="zero_force_ds_cpu_optimizer"):
        zero_ext.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=config)
    engine, *_ = zero_ext.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()),
                                     config={**config, "zero_force_ds_cpu_optimizer": False})
    engine.destroy()


def test_config_errors_are_assertion_errors_too():
    from zero_ext.config import ConfigError, load_config

    with pytest.raises(AssertionError, match="multiple of 2") as info:
        load_config(_config(zero_optimization={"stage": 2, "allgather_bucket_size": 5}))
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_forward_only_engine_backward_and_step_are_assertion_errors():
    import zero_ext

    engine, *_ = zero_ext.initialize(model=MLP(), config=_config())
    loss = engine.module.loss(MLP.batch(2, torch.Generator().manual_seed(0)))
    with pytest.raises(AssertionError, match="has no optimizer"):
        engine.backward(loss)
    with pytest.raises(AssertionError, match="has no optimizer"):
        engine.step()


def test_no_sync_misuse_is_an_assertion_error():
    import zero_ext

    cfg = _config(optimizer={"type": "AdamW"})
    engine, *_ = zero_ext.initialize(model=MLP(), config={**cfg, "zero_optimization": {"stage": 2}})
    with pytest.raises(AssertionError, match="incompatible with ZeRO stage 2"):
        with engine.no_sync():
            pass
    engine, *_ = zero_ext.initialize(model=MLP(), config=cfg)
    with engine.no_sync():
        with pytest.raises(AssertionError, match="reentry is unsupported"):
            with engine.no_sync():
                pass
        engine.backward(engine.module.loss(MLP.batch(2, torch.Generator().manual_seed(0))))
        with pytest.raises(AssertionError, match="inside no_sync context manager"):
            engine.step()
    assert not engine._no_sync  # the refused inner block left the outer one in force until its end


def test_scheduler_over_another_optimizer_is_taken_with_a_warning():
    """As DeepSpeed takes it (its check misses torch 2's schedulers), but aloud: its learning rates never
    reach the optimizer the engine steps."""
    import zero_ext

    model = MLP()
    other = torch.optim.Adam(MLP().parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(other, lambda s: 1.0)
    with pytest.warns(UserWarning, match="schedules another optimizer.*never reach training"):
        _, _, _, got = zero_ext.initialize(model=model, config=_config(optimizer={"type": "AdamW"}),
                                           lr_scheduler=sched)
    assert got is sched
    mine = torch.optim.Adam(model.parameters())
    engine, _, _, got = zero_ext.initialize(model=model, optimizer=mine, config=_config(),
                                            lr_scheduler=torch.optim.lr_scheduler.LambdaLR(mine, lambda s: 1.0))
    assert got.optimizer is mine


def _unused_parameter():
    import zero_ext

    model = MLP()
    config = _config(optimizer={"type": "AdamW"},
                     zero_optimization={"stage": 2, "ignore_unused_parameters": False})
    engine, *_ = zero_ext.initialize(model=model, config=config)
    x, _ = MLP.batch(2, torch.Generator().manual_seed(0))
    try:  # the head is not used: its parameters get no gradient
        engine.backward(torch.tanh(engine.module.body(torch.tanh(engine.module.frozen(x)))).sum())
        engine.step()
    except AssertionError as exc:
        return isinstance(exc, RuntimeError), str(exc)
    return None


def test_unused_parameter_is_an_assertion_error_naming_the_key():
    is_runtime, message = run_ranks(1, _unused_parameter)[0]
    assert is_runtime and "ignore_unused_parameters" in message


def _tags_differ():
    import zero_ext

    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(optimizer={"type": "AdamW"},
                                                                 checkpoint={"tag_validation": "FAIL"}))
    import tempfile

    try:
        engine.save_checkpoint(tempfile.mkdtemp(), tag=f"tag-{torch.distributed.get_rank()}")
    except AssertionError as exc:
        return "tags differ" in str(exc)
    return False


def test_checkpoint_tags_that_differ_under_fail_are_an_assertion_error():
    assert run_ranks(2, _tags_differ) == [True, True]


# -- wall_clock_breakdown -----------------------------------------------------------------------------------

TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")


def _timed_run(stage, gas, steps_per_print, micro_steps):
    import io
    from contextlib import redirect_stdout

    import zero_ext

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "wall_clock_breakdown": True,
              "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage}}
    if steps_per_print is not None:
        config["steps_per_print"] = steps_per_print
    engine, *_ = zero_ext.initialize(model=MLP(), config=config)
    gen, out, snapshots = torch.Generator().manual_seed(0), io.StringIO(), []
    with redirect_stdout(out):
        for _ in range(micro_steps):
            engine.backward(engine(MLP.batch(2, gen)[0]).pow(2).mean())
            engine.step()
            snapshots.append(engine.get_wall_clock_timers())
    return out.getvalue().splitlines(), snapshots


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_wall_clock_breakdown_prints_deepspeeds_lines_at_steps_per_print(stage):
    # gas 2, steps_per_print 2: 8 micro steps = 4 optimizer steps, printed after the 2nd and 4th
    ranks = run_ranks(2, _timed_run, stage, 2, 2, 8)
    lines, snapshots = ranks[0]
    assert ranks[1][0] == []  # rank 0 prints
    assert len(lines) == 4 and all(line.startswith("time (ms) | ") for line in lines)
    micro = [f"{t}_microstep" for t in TIMERS]
    for line, names in zip(lines, [micro, TIMERS] * 2):
        fields = [f.split(": ") for f in line.split(" | ")[1:]]
        assert [n for n, _ in fields] == list(names) and all(float(v) >= 0 for _, v in fields)
    last = snapshots[-1]
    assert set(last) == set(micro) | set(TIMERS)
    assert last["fwd_microstep"] > 0 and last["bwd_microstep"] >= last["bwd_inner_microstep"] > 0
    assert last["step_microstep"] > 0 and all(s["bwd_allreduce"] >= 0 for s in snapshots)
    assert any(s["bwd_allreduce"] > 0 for s in snapshots)  # the reducer's work is timed at every stage


def test_wall_clock_breakdown_without_steps_per_print_prints_every_optimizer_step():
    lines, snapshots = run_ranks(1, _timed_run, 0, 1, None, 3)[0]
    assert len(lines) == 6 and len(snapshots) == 3


def test_wall_clock_breakdown_off_prints_nothing_and_has_no_timers():
    import zero_ext

    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(optimizer={"type": "AdamW"}))
    engine.backward(engine.module.loss(MLP.batch(2, torch.Generator().manual_seed(0))))
    engine.step()
    assert engine.get_wall_clock_timers() == {}


# -- bf16 with data_types.grad_accum_dtype fp32 at ZeRO-1 ---------------------------------------------------
# DeepSpeed's BF16 optimizer: each micro step's bf16 gradients are added into a full fp32 buffer, which is
# averaged across ranks in fp32 at the boundary. The reference below does exactly that on one process with
# zero_ext's CPUAdam (the optimizer the engine runs on CPU tensors); two ranks' fp32 sums are exact in either
# order, so the masters must be equal bit for bit.

GAS = 4


def _bf16_batches(world):
    gen = torch.Generator().manual_seed(5)
    return [[[MLP.batch(2, gen, torch.bfloat16) for _ in range(world)] for _ in range(GAS)] for _ in range(STEPS)]


def _bf16_run(accum, immediate=None):
    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    if accum:
        config["data_types"] = {"grad_accum_dtype": accum}
    if immediate is not None:
        config["bf16"]["immediate_grad_update"] = immediate
    engine, *_ = zero_ext.initialize(model=MLP(), config=config)
    for step in _bf16_batches(world):
        for micro in step:
            engine.backward(engine.module.loss(micro[rank]))
            engine.step()
    return {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if p.requires_grad}


def _bf16_fp32_accum_reference(world):
    from zero_ext.ops import CPUAdam

    torch.manual_seed(0)
    model = MLP()
    for p in model.parameters():  # bf16 casts the parameters; the buffer stays fp32 (as initialize does)
        p.data = p.data.to(torch.bfloat16)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for _, p in trained]
    opt = CPUAdam(masters, lr=1e-3, weight_decay=0.01, adamw_mode=True)
    for step in _bf16_batches(world):
        acc = [[torch.zeros_like(m) for m in masters] for _ in range(world)]
        for micro in step:
            for r in range(world):
                model.zero_grad()
                (model.loss(micro[r]) / GAS).backward()
                for a, (_, p) in zip(acc[r], trained):
                    a.add_(p.grad)
        for m, *per_rank in zip(masters, *acc):
            total = per_rank[0].clone()
            for a in per_rank[1:]:
                total.add_(a)
            m.grad = total.mul_(1.0 / world) if world > 1 else total
        opt.step()
        with torch.no_grad():
            for m, (_, p) in zip(masters, trained):
                p.copy_(m)
    return {n: m for m, (n, _) in zip(masters, trained)}


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_grad_accum_fp32_at_stage_1_accumulates_in_fp32(world):
    want = _bf16_fp32_accum_reference(world)
    got = run_ranks(world, _bf16_run, "fp32")[0]
    assert all(torch.equal(got[n], want[n]) for n in want)
    if world == 1:  # bf16 accumulation (the default) gives other masters: the test tells them apart
        plain = run_ranks(1, _bf16_run, None)[0]
        assert any(not torch.equal(plain[n], want[n]) for n in want)


def test_bf16_immediate_grad_update_trains_the_same_masters():
    # DeepSpeed's BF16 optimizer adds each parameter's gradient at its hook; zero_ext at the backward's end:
    # the same fp32 sums, so true and false give the reference's masters bit for bit
    want = _bf16_fp32_accum_reference(2)
    for immediate in (True, False):
        got = run_ranks(2, _bf16_run, "fp32", immediate)[0]
        assert all(torch.equal(got[n], want[n]) for n in want), immediate


def test_grad_accum_dtype_fp32_with_bf16_at_stage_0_is_refused():
    import zero_ext
    from zero_ext.config import ConfigError

    with pytest.raises(ConfigError, match="grad_accum_dtype"):
        zero_ext.initialize(model=MLP(), config={"train_batch_size": 2, "bf16": {"enabled": True},
                                                 "data_types": {"grad_accum_dtype": "fp32"}})
