"""torch_autocast (DeepSpeed's section; zero_ext/precision/autocast.py): the forward under torch.autocast,
the lower-precision-safe parameters' gradients reduced (and at ZeRO-3 gathered) in the autocast dtype,
fp16's GradScaler-style loss scaling, the config's refusals.

Parity reference: one plain PyTorch process runs the same model under the same ``torch.autocast`` on each
rank's micro batch, and averages the two gradients as the engine's collectives do: a safe parameter's
(Linear's) as ``bf16(bf16(g0) + bf16(g1)) / 2`` at stages 1-3, every other gradient in fp32 (and at stage 0,
as DeepSpeed's, all of them); torch's SGD then applies them. The per-rank gradients are the same
computation on the same values (on one CPU thread, as the ranks: CPU layer_norm's bf16 backward rounds its
weight gradient differently with more threads), so losses and trained parameters must agree exactly
(stated tolerance 0). An fp32 reduction of the Linear gradients differs by bf16 rounding, about 2**-8 of
the update (checked below), so a reduction in the wrong dtype fails.
"""
import pytest
import torch
from torch import nn

from helpers.engine import fp32_masters, full_params
from helpers.harness import RankFailed, run_ranks

STEPS = 3
LR = 0.5
TOL = 0.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _loss(out, y):
    return (out.float() - y).pow(2).mean()


def _batches(world):
    gen = torch.Generator().manual_seed(3)
    return [[(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(world)]
            for _ in range(STEPS)]


def _config(stage, dtype="bfloat16", **autocast):
    return {"train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
            "torch_autocast": {"enabled": True, "dtype": dtype, **autocast},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 50,
                                  **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}}


def _engine(config):
    import zero_ext

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, _, _, _ = zero_ext.initialize(model=model, optimizer=opt, config=config)
    return engine


def _train(stage):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine = _engine(_config(stage))
    losses = []
    for step in _batches(world):
        x, y = step[rank]
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # at stage 3 the fp32 masters (a gathered Linear weight is bf16-rounded: it travels in bf16)
    params = fp32_masters(engine) if stage == 3 else full_params(engine)
    engine.destroy()
    return losses, params


def _reference(stage, world=2):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: CPU layer_norm's bf16 backward rounds differently with more threads
    try:
        return _reference_run(stage, world)
    finally:
        torch.set_num_threads(threads)


def _reference_run(stage, world):
    torch.manual_seed(0)
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in _batches(world):
        grads = []
        for x, y in step:
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = _loss(out, y)
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for n, p in model.named_parameters():
                if stage > 0 and not n.startswith("norm"):  # a Linear's: summed in bf16
                    total = grads[0][n].bfloat16()
                    for g in grads[1:]:
                        total = (total.float() + g[n].bfloat16().float()).bfloat16()
                    g = total.float() / world
                else:
                    g = sum(g[n] for g in grads) / world
                p.grad = g
        sgd.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_autocast_matches_plain_pytorch_under_autocast(stage):
    results = run_ranks(2, _train, stage)
    ref_losses, ref_params = _reference(stage)
    for rank, (losses, params) in enumerate(results):
        assert losses == ref_losses[rank::2]
        for name, value in ref_params.items():
            err = (params[name] - value).abs().max().item()
            assert err <= TOL, (stage, rank, name, err)


def test_reference_tells_a_bf16_reduction_from_an_fp32_one():
    """The check above can fail: the bf16-reducing reference ends far from the fp32-reducing one."""
    _, bf16 = _reference(1)
    _, fp32 = _reference(0)
    assert max((bf16[n] - fp32[n]).abs().max().item() for n in bf16 if not n.startswith("norm")) > 1e-5


# -- which parameters are marked, which dtype travels --------------------------------------------------------

def _marks(stage, autocast):
    from zero_ext.runtime.torch_autocast import get_comm_dtype, has_comm_dtype

    engine = _engine(_config(stage, **autocast))
    marks = {n: (has_comm_dtype(p), get_comm_dtype(p)) for n, p in engine.module.named_parameters()}
    out = (marks, engine.torch_autocast_enabled(), engine.torch_autocast_dtype(),
           engine.torch_autocast_lower_precision_safe_modules())
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_comm_dtype_marks_exactly_the_safe_modules_parameters(stage):
    marks, enabled, dtype, names = run_ranks(1, _marks, stage, {})[0]
    assert enabled and dtype == torch.bfloat16
    assert names == ["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                     "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d"]
    assert {n for n, (has, _) in marks.items() if has} == {"inp.weight", "inp.bias", "out.weight", "out.bias"}
    assert all(d == (torch.bfloat16 if has else torch.float32) for has, d in marks.values())
    marks, _, _, names = run_ranks(1, _marks, stage, {"lower_precision_safe_modules": ["torch.nn.LayerNorm"]})[0]
    assert names == ["torch.nn.LayerNorm"]
    assert {n for n, (has, _) in marks.items() if has} == {"norm.weight", "norm.bias"}


def _traffic(stage, enabled):
    import zero_ext
    from zero_ext.comm import traffic

    seen = []
    verbs = ("all_reduce", "reduce", "reduce_scatter_tensor", "all_gather_into")
    originals = {v: getattr(zero_ext.comm, v) for v in verbs}

    def recorder(verb):
        def call(tensor, *args, **kwargs):
            seen.append((verb, tensor.dtype))
            return originals[verb](tensor, *args, **kwargs)
        return call

    config = _config(stage)
    config["torch_autocast"]["enabled"] = enabled
    engine = _engine(config)
    rank = torch.distributed.get_rank()
    x, y = _batches(2)[0][rank]
    for v in verbs:
        setattr(zero_ext.comm, v, recorder(v))
    traffic.start()
    try:
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    finally:
        for v in verbs:
            setattr(zero_ext.comm, v, originals[v])
        counted = traffic.snapshot()["by_verb"]
        traffic.stop()
    engine.destroy()
    # (not the agreements' ints, nor the overflow check's fp64 norm)
    return sorted({(v, d) for v, d in seen if d in (torch.float32, torch.bfloat16)}, key=str), counted


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_safe_gradients_travel_in_the_autocast_dtype(stage):
    dtypes, nbytes = run_ranks(2, _traffic, stage, True)[0]
    plain_dtypes, plain_nbytes = run_ranks(2, _traffic, stage, False)[0]
    reducing = "reduce" if stage == 2 else "all_reduce"  # (gloo: stages 1 and 3 reduce-scatter by all-reduce)
    assert (reducing, torch.bfloat16) in dtypes and (reducing, torch.float32) in dtypes  # Linear / LayerNorm
    assert all(d == torch.float32 for _, d in plain_dtypes)
    if stage == 3:  # the Linear weights are gathered in bf16 too
        assert ("all_gather_into", torch.bfloat16) in dtypes
    if stage != 2:  # (the traffic counter does not count stage 2's dist.reduce)
        assert nbytes["all_reduce"][0] < plain_nbytes["all_reduce"][0]  # the gradients' bytes


def test_stage0_reduces_in_the_usual_dtype_as_deepspeed():
    dtypes, _ = run_ranks(2, _traffic, 0, True)[0]
    assert dtypes and all(d == torch.float32 for _, d in dtypes)


# -- fp16: GradScaler's scaling ------------------------------------------------------------------------------

def _fp16(stage, inf_step):
    rank = torch.distributed.get_rank()
    engine = _engine(_config(stage, dtype="fp16"))
    trajectory = []
    before = None
    for step, micros in enumerate(_batches(2) * 2):
        x, y = micros[rank]
        out = engine(x)
        assert out.dtype == torch.float16
        loss = _loss(out, y)
        if step == inf_step and rank == 1:
            loss = loss * float("inf")
        if step == inf_step:
            before = {n: v.clone() for n, v in full_params(engine).items()}
        engine.backward(loss)
        engine.step()
        if step == inf_step:
            after = full_params(engine)
            unchanged = all(torch.equal(before[n], after[n]) for n in before)
        trajectory.append((engine.was_step_applied(), engine.optimizer.cur_scale))
    engine.destroy()
    return trajectory, unchanged, engine.skipped_steps


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_autocast_skips_an_overflow_step_and_halves_the_scale(stage):
    for trajectory, unchanged, skipped in run_ranks(2, _fp16, stage, 2):
        assert trajectory == [(True, 65536.0), (True, 65536.0), (False, 32768.0), (True, 32768.0),
                              (True, 32768.0), (True, 32768.0)]
        assert unchanged and skipped == 1


# -- nested autocast ---------------------------------------------------------------------------------------

def _nested(enabled):
    config = _config(1)
    config["torch_autocast"]["enabled"] = enabled
    engine = _engine(config)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.float16):  # (separate blocks: autocast's cast cache is per block)
        outside = engine.module(x).dtype
    with torch.autocast("cpu", dtype=torch.float16):
        inside = engine(x).dtype
    engine.destroy()
    return inside, outside


def test_an_outer_autocast_gives_way_to_the_engines_config():
    assert run_ranks(1, _nested, True)[0] == (torch.bfloat16, torch.float16)  # the engine's dtype wins
    assert run_ranks(1, _nested, False)[0] == (torch.float32, torch.float16)  # off inside the engine


# -- config errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("section, match", [
    ({"enabled": True, "dtype": "float8"}, r"torch_autocast\.dtype.*bf16 or fp16"),
    ({"enabled": True, "dtype": "fp32"}, r"torch_autocast\.dtype.*bf16 or fp16"),
    ({"enabled": True, "lower_precision_safe_modules": [3]}, r"lower_precision_safe_modules.*list of class names"),
    ({"enabled": True, "lower_precision_safe_modules": "torch.nn.Linear"}, r"lower_precision_safe_modules"),
])
def test_bad_sections_are_refused_by_name(section, match):
    from zero_ext.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config({"train_batch_size": 1, "torch_autocast": section})


@pytest.mark.parametrize("extra, match", [
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, r"zero_quantized_weights"),
    ({"fp16": {"enabled": True}}, r"fp16\.enabled or an fp16 torch_autocast"),
])
def test_incompatible_combinations_are_refused(extra, match):
    from zero_ext.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config({"train_batch_size": 1, "torch_autocast": {"enabled": True, "dtype": "fp16"}, **extra})


def test_dtype_spellings_are_deepspeeds():
    from zero_ext.config import load_config
    from zero_ext.runtime.config import DeepSpeedConfig

    for name, want in (("torch.bfloat16", "bf16"), ("bfloat16", "bf16"), ("bf16", "bf16"), ("half", "fp16"),
                       ("torch.float16", "fp16"), (torch.float16, "fp16")):
        assert load_config({"train_batch_size": 1, "torch_autocast": {"dtype": name}}).torch_autocast.dtype == want
    ds = DeepSpeedConfig({"train_batch_size": 1, "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}})
    assert ds.torch_autocast_enabled and ds.torch_autocast_dtype == torch.bfloat16


def _unimportable():
    _engine(_config(1, lower_precision_safe_modules=["no_such_package.Linear"]))


def test_a_module_name_that_does_not_import_is_refused():
    with pytest.raises(RankFailed, match=r"torch_autocast\.lower_precision_safe_modules.*no_such_package\.Linear"):
        run_ranks(1, _unimportable)


# -- a 16-bit model under autocast without a bf16 section ---------------------------------------------------

def _bf16_model_stage3():
    import zero_ext

    config = _config(3)
    with zero_ext.zero.Init(config_dict_or_path={**config, "bf16": {"enabled": True}}):
        torch.manual_seed(0)
        model = Net()
    engine, _, _, _ = zero_ext.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                          config=config)
    rank = torch.distributed.get_rank()
    x, y = _batches(2)[0][rank]
    before = fp32_masters(engine)
    loss = _loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    after = fp32_masters(engine)
    dtypes = {p.dtype for p in engine.module.parameters()}
    engine.destroy()
    return dtypes, engine.was_step_applied(), all(not torch.equal(before[n], after[n]) for n in before)


def test_a_bf16_model_built_under_zero_init_trains_in_its_dtype_at_stage3():
    """DeepSpeed's: with torch_autocast and no bf16/fp16 section the parameters keep zero.Init's dtype."""
    for dtypes, applied, moved in run_ranks(2, _bf16_model_stage3):
        assert dtypes == {torch.bfloat16} and applied and moved
