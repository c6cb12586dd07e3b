"""bf16.bf16_master_weights_and_grads / bf16.bf16_optimizer_states (zero_ext/optim/bf16_master.py).

Parity: 2 gloo ranks against a single-process reference that keeps bf16 masters as DeepSpeed does — each
rank's bf16 gradients averaged in fp32 and rounded to bf16, clipped in bf16, and an AdamW step computed
in fp32 from the bf16 master (and bf16 or fp32 moments) whose results are rounded back to their storage
dtype (what the CPU Adam does with bf16 tensors). Tolerance: one bf16 ulp of each value (rtol 2**-7,
atol 1e-6): the ranks' bf16 reduction and accumulation may round a gradient differently from the
reference's fp32 average, and a device step clips the bf16 gradient in bf16 where the CPU Adam
scales it in fp32 (on this CPU run every case agrees bit for bit). An fp32-master run of the same
config is off by up to ~5 ulps in every element after 6 steps (checked below), so the comparison tells
the two apart.
"""
import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP

STEPS = 6
LR_SCALE = 0.05  # MLP.param_groups' lrs (2e-2, 1e-2) times this: updates below a bf16 ulp, which bf16 masters lose


def _config(stage, states, offload, clip=0.0, master=True, gas=1):
    zero = {"stage": stage, "reduce_bucket_size": 50}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    bf16 = {"enabled": True}
    if master:
        bf16["bf16_master_weights_and_grads"] = True
        bf16["bf16_optimizer_states"] = states
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "bf16": bf16,
            "gradient_clipping": clip, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero}


def _groups(model):
    groups = model.param_groups()
    for g in groups:
        g["lr"] *= LR_SCALE
    return groups


def _batch(step, micro, rank):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return MLP.batch(2, gen, torch.bfloat16)


def _train(stage, states, offload, clip=0.0, master=True, gas=1):
    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    torch.manual_seed(0)
    model = MLP()
    engine, opt, _, _ = zero_ext.initialize(model=model, model_parameters=_groups(model),
                                            config=_config(stage, states, offload, clip, master, gas))
    rank = torch.distributed.get_rank()
    for step in range(STEPS):
        for micro in range(gas):
            engine.backward(engine.module.loss(_batch(step, micro, rank)))
            engine.step()
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    params = dict(zip(names, [p for p in engine.module.parameters() if p.requires_grad]))
    out = {"master": {n: safe_get_full_fp32_param(p) for n, p in params.items()},
           "exp_avg_sq": {n: safe_get_full_optimizer_state(p, "exp_avg_sq") for n, p in params.items()},
           "master_dtypes": {g.master.dtype for g in opt.flat_groups},
           "grad_dtypes": {g.ensure_grad().dtype if hasattr(g, "ensure_grad") else g.grad.dtype
                           for g in opt.flat_groups},
           "norm": opt.global_grad_norm,
           "state_dtypes": {t.dtype for s in opt.optimizer.state.values() for t in s.values()
                            if torch.is_tensor(t) and t.dim() > 0}}
    engine.destroy()
    return out


def _reference(states_bf16, clip=0.0, gas=1, world=2):
    """Single process: bf16 parameters stepped by AdamW computed in fp32, stored in bf16 (moments in
    bf16 or fp32); with gas > 1 each micro step's averaged gradient is added into a bf16 gradient, as
    stages 2 and 3 reduce every micro step into their bf16 partitions."""
    torch.manual_seed(0)
    model = MLP()
    for p in model.parameters():  # bf16 casts the parameters, the buffer stays fp32 (as initialize does)
        p.data = p.data.to(torch.bfloat16)
    groups = _groups(model)
    sdt = torch.bfloat16 if states_bf16 else torch.float32
    live = [p for g in groups for p in g["params"] if p.requires_grad]
    m = {p: torch.zeros_like(p, dtype=sdt) for p in live}
    v = {p: torch.zeros_like(p, dtype=sdt) for p in live}
    for step in range(STEPS):
        grads = {p: torch.zeros_like(p) for p in live}
        for micro in range(gas):
            mean = {p: torch.zeros_like(p, dtype=torch.float32) for p in live}
            for rank in range(world):
                model.zero_grad()
                model.loss(_batch(step, micro, rank)).backward()
                for p in live:
                    mean[p] += p.grad.float() / world
            for p in live:
                grads[p] += mean[p].to(torch.bfloat16)  # each micro step's average into the bf16 partition
        if clip > 0:
            norm = sum(g.double().pow(2).sum() for g in grads.values()).item() ** 0.5
            coef = clip / (norm + 1e-6)
            if coef < 1:  # (the CPU Adam scales the gradient as it loads it, in fp32: no bf16 rounding)
                grads = {p: g.float() * coef for p, g in grads.items()}
        t = step + 1
        with torch.no_grad():
            for group in groups:
                for p in group["params"]:
                    if not p.requires_grad:
                        continue
                    p32, g, m32, v32 = p.float(), grads[p].float(), m[p].float(), v[p].float()
                    lr, wd = group["lr"], group["weight_decay"]
                    p32.mul_(1 - lr * wd)
                    m32.lerp_(g, 0.1)
                    v32.mul_(0.999).addcmul_(g, g, value=0.001)
                    denom = (v32.sqrt() / (1 - 0.999 ** t) ** 0.5).add_(1e-8)
                    p32.addcdiv_(m32, denom, value=-lr / (1 - 0.9 ** t))
                    p.copy_(p32)
                    m[p].copy_(m32)
                    v[p].copy_(v32)
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: p.detach().float() for p in live}, {names[id(p)]: v[p].float() for p in live}


def _close(a, b):
    return torch.allclose(a, b, rtol=2 ** -7, atol=1e-6)


CASES = [(1, True, False), (2, True, False), (3, True, False),
         (1, False, True), (2, False, True), (3, False, True),
         (2, True, True), (3, True, True)]


@pytest.mark.parametrize("stage, states_bf16, offload", CASES)
def test_parity_with_a_bf16_master_reference(stage, states_bf16, offload):
    ranks = run_ranks(2, _train, stage, states_bf16, offload)
    ref, ref_v = _reference(states_bf16)
    for out in ranks:
        assert out["master_dtypes"] == {torch.bfloat16}
        assert out["grad_dtypes"] == {torch.bfloat16}
        assert out["state_dtypes"] == {torch.bfloat16 if states_bf16 else torch.float32}
        for name, want in ref.items():
            got = out["master"][name].float()
            assert _close(got, want), (name, (got - want).abs().max().item())
            assert _close(out["exp_avg_sq"][name].float(), ref_v[name]), name


@pytest.mark.parametrize("stage", [2, 3])
def test_clipping_and_accumulation_in_bf16(stage):
    """(Stage 1 accumulates micro steps in the parameters' bf16 .grad before reducing, DeepSpeed's order
    too: the reference above does not model it, so stage 1 is left to the parity test.)"""
    ranks = run_ranks(2, _train, stage, True, False, 0.05, True, 2)
    ref, _ = _reference(True, clip=0.05, gas=2)
    assert ranks[0]["norm"] > 0.05  # (the clip applied)
    for name, want in ref.items():
        got = ranks[0]["master"][name].float()
        assert _close(got, want), (name, (got - want).abs().max().item())


def test_fp32_masters_drift_from_the_bf16_reference():
    """The tolerance above tells bf16 masters from fp32 ones: updates below a bf16 ulp accumulate in fp32."""
    out = run_ranks(2, _train, 2, True, False, 0.0, False)[0]
    ref, _ = _reference(False)
    assert out["master_dtypes"] == {torch.float32}
    assert not all(_close(out["master"][n].float(), want) for n, want in ref.items())


# -- memory_breakdown against docs/memory.md's bf16-master rows -----------------------------------------

def _memory(stage, states, offload):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    engine, opt, _, _ = zero_ext.initialize(model=model, model_parameters=_groups(model),
                                            config=_config(stage, states, offload))
    rank = torch.distributed.get_rank()
    points = {}
    for step in range(2):
        engine.backward(engine.module.loss(_batch(step, 0, rank)))
        points[f"after backward {step}"] = engine.memory_breakdown()
        engine.step()
        points[f"after step {step}"] = engine.memory_breakdown()
    psi = sum(g.padded for g in opt.flat_groups)  # stage 3: this rank's pieces
    frozen = sum(getattr(p, "ds_tensor", p).numel() * p.element_size()
                 for p in engine.module.parameters() if not p.requires_grad)
    engine.destroy()
    return points, psi, frozen


def _expected(stage, states, offload, psi, frozen, world, point):
    """docs/memory.md: bf16 parameters; the master and the gradient partition in bf16 — the master is the
    parameters' own partition (the pieces at stage 3) unless offloaded, and at stage 1 the gradient
    partition is the gradient buffer's; Adam's two moments in bf16 (2 + 2 bytes) or fp32 (4 + 4)."""
    shard = psi // world if stage in (1, 2) else psi
    freed = stage == 2 and not offload and point.startswith("after step")
    dev = {"params": 2 * psi + frozen, "grads": 2 * psi if stage < 2 else 0,
           "fp32_master": 0, "fp32_grads": 0 if stage == 1 or freed else 2 * shard,
           "optimizer_state": (4 if states else 8) * shard}
    host = dict.fromkeys(dev, 0)
    if offload:  # master and gradient partition: bf16 host tensors of their own, kept between steps
        host.update(fp32_master=2 * shard, fp32_grads=2 * shard, optimizer_state=dev["optimizer_state"])
        dev.update(fp32_master=0, fp32_grads=0, optimizer_state=0)
    return dev, host


MEMORY_CASES = [(1, True, False), (2, True, False), (3, True, False), (2, False, True), (3, True, True)]


@pytest.mark.parametrize("stage, states_bf16, offload", MEMORY_CASES)
def test_memory_breakdown_follows_the_bf16_formulas(stage, states_bf16, offload):
    for rank, (points, psi, frozen) in enumerate(run_ranks(2, _memory, stage, states_bf16, offload)):
        for point, table in points.items():
            if point == "after backward 0":
                continue  # Adam makes its state at the first step
            dev, host = _expected(stage, states_bf16, offload, psi, frozen, 2, point)
            for kind in dev:
                got = (table[kind]["accelerator"], table[kind]["host"])
                assert got == (dev[kind], host[kind]), f"rank {rank}, {point}, {kind}: {got}"


# -- checkpoints: bf16 masters saved and loaded exactly; zero_to_fp32 still gives fp32 ------------------------

def _checkpoint(stage, states, offload, path, resume):
    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    torch.manual_seed(0)
    model = MLP()
    engine, opt, _, _ = zero_ext.initialize(model=model, model_parameters=_groups(model),
                                            config=_config(stage, states, offload))
    rank = torch.distributed.get_rank()
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    loaded = None
    if resume:
        engine.load_checkpoint(path)
        loaded = {n: safe_get_full_fp32_param(p) for n, p in params}
        loaded.update({f"exp_avg {n}": safe_get_full_optimizer_state(p, "exp_avg") for n, p in params})
    else:
        for step in range(3):
            engine.backward(engine.module.loss(_batch(step, 0, rank)))
            engine.step()
        engine.save_checkpoint(path, tag="t")
    for step in range(3, 5):
        engine.backward(engine.module.loss(_batch(step, 0, rank)))
        engine.step()
    out = {"master": {n: safe_get_full_fp32_param(p) for n, p in params}, "loaded": loaded,
           "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in params},
           "master_dtypes": {g.master.dtype for g in opt.flat_groups},
           "state_dtypes": {t.dtype for s in opt.optimizer.state.values() for t in s.values()
                            if torch.is_tensor(t) and t.dim() > 0}}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage, states_bf16, offload", [(1, True, False), (2, False, True), (3, True, False)])
def test_checkpoint_round_trip_is_exact(stage, states_bf16, offload, tmp_path):
    from zero_ext.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    path = str(tmp_path)
    straight = run_ranks(2, _checkpoint, stage, states_bf16, offload, path, False)[0]
    saved = get_fp32_state_dict_from_zero_checkpoint(path, tag="t")
    resumed = run_ranks(2, _checkpoint, stage, states_bf16, offload, path, True)[0]
    assert resumed["master_dtypes"] == {torch.bfloat16}
    assert resumed["state_dtypes"] == straight["state_dtypes"] == {torch.bfloat16 if states_bf16 else torch.float32}
    for name, want in straight["master"].items():
        assert torch.equal(resumed["master"][name], want), name
        assert resumed["loaded"][f"exp_avg {name}"].dtype == torch.float32  # (the routine widens)
        assert torch.equal(resumed["exp_avg"][name], straight["exp_avg"][name]), name
        assert saved[name].dtype == torch.float32  # zero_to_fp32 widens the bf16 masters
        assert torch.equal(saved[name], resumed["loaded"][name])


# -- what is refused, with the fix named --------------------------------------------------------------------

def _refusal(overrides, client_fp32_states=None):
    import zero_ext
    from zero_ext.ops.adam import CPUAdam

    torch.manual_seed(0)
    model = MLP()
    config = _config(2, True, False)
    for section, values in overrides.items():
        config[section] = {**config.get(section, {}), **values}
    optimizer = None
    if client_fp32_states is not None:
        config.pop("optimizer")
        optimizer = CPUAdam([p for p in model.parameters() if p.requires_grad],
                            fp32_optimizer_states=client_fp32_states)
    try:
        engine, opt, _, _ = zero_ext.initialize(model=model, optimizer=optimizer, config=config)
    except Exception as exc:  # noqa: BLE001 (the test reads the type and message)
        return type(exc).__name__, isinstance(exc, (ValueError, AssertionError)), str(exc)
    engine.backward(engine.module.loss(_batch(0, 0, 0)))
    engine.step()
    states = {t.dtype for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()}
    engine.destroy()
    return None, None, states


OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
REFUSED = [
    ({"zero_optimization": {"stage": 0}}, "ConfigError", "needs ZeRO stage 1, 2 or 3"),
    ({"bf16": {"bf16_optimizer_states": False}}, "ConfigError", "offload_optimizer.device to 'cpu'"),
    ({"bf16": {"enabled": False}}, "ConfigError", "set bf16.enabled to true"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
     "UnimplementedFeatureError", "use offload_optimizer.device 'cpu'"),
    ({"zero_optimization": OFFLOAD, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}},
     "ClientOptimizerError", "without params.torch_adam"),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, "UnsupportedDtypeError", "accumulate in bf16 partitions"),
]


@pytest.mark.parametrize("overrides, kind, fix", REFUSED)
def test_unsupported_combinations_are_refused_with_the_fix(overrides, kind, fix):
    name, is_value_or_assert, message = run_ranks(1, _refusal, overrides)[0]
    assert name == kind and is_value_or_assert, message
    assert fix in message


def test_client_cpu_adam_must_keep_bf16_states_under_offload():
    name, is_assert, message = run_ranks(1, _refusal, {"zero_optimization": OFFLOAD}, True)[0]
    assert name == "ClientOptimizerError" and is_assert and "fp32_optimizer_states=False" in message
    assert run_ranks(1, _refusal, {"zero_optimization": OFFLOAD}, False)[0] == (None, None, {torch.bfloat16})


def test_config_built_cpu_adam_is_switched_to_bf16_states():
    """optimizer.params.fp32_optimizer_states true is overridden (DeepSpeed warns and does the same)."""
    overrides = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "fp32_optimizer_states": True}}}
    assert run_ranks(1, _refusal, overrides)[0] == (None, None, {torch.bfloat16})
    overrides["bf16"] = {"bf16_optimizer_states": False}
    overrides["zero_optimization"] = OFFLOAD
    assert run_ranks(1, _refusal, overrides)[0] == (None, None, {torch.float32})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_adam_for_bf16_masters_is_torchs_fused_kernel():
    """On the device the config's Adam is FusedAdam; over bf16 masters with bf16 states (what check_base
    sets) it steps with torch's fused kernel (fp32 math, one rounding, as DeepSpeed's FusedAdam)."""
    from zero_ext.config import load_config
    from zero_ext.ops.fused_adam import FusedAdam
    from zero_ext.optim.factory import build_optimizer

    p = torch.nn.Parameter(torch.randn(64, device="cuda", dtype=torch.bfloat16))
    q = torch.nn.Parameter(p.detach().clone())
    cfg = load_config(_config(2, True, False))
    opt = build_optimizer(cfg.optimizer, [{"params": [p]}], bf16_master=True)
    assert isinstance(opt, FusedAdam)
    opt.fp32_optimizer_states = False
    ref = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.0, fused=True)
    p.grad = torch.randn_like(p)
    q.grad = p.grad.clone()
    opt.step()
    ref.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(p, q)


def _reshard_and_set(path, stage):
    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param

    torch.manual_seed(1)
    model = MLP()
    engine, opt, _, _ = zero_ext.initialize(model=model, model_parameters=_groups(model),
                                            config=_config(stage, True, False))
    engine.load_checkpoint(path, tag="t")
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    out = {"loaded": {n: safe_get_full_fp32_param(p) for n, p in params},
           "state_dtypes": {t.dtype for s in opt.optimizer.state.values() for t in s.values()
                            if torch.is_tensor(t) and t.dim() > 0},
           "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in params}}
    name, p = params[0]
    value = torch.full(tuple(getattr(p, "ds_shape", p.shape)), 1.0 + 2 ** -10)  # not a bf16 value: rounded
    safe_set_full_fp32_param(p, value)
    out["set"] = safe_get_full_fp32_param(p)
    engine.destroy()
    return out


def test_checkpoint_loads_into_another_world_size_and_safe_set_rounds_to_bf16(tmp_path):
    """2 ranks save at stage 2, 1 rank loads at stage 3: bf16 masters and bf16 moments resharded exactly."""
    path = str(tmp_path)
    straight = run_ranks(2, _checkpoint, 2, True, False, path, False)[0]
    resumed = run_ranks(2, _checkpoint, 2, True, False, path, True)[0]
    out = run_ranks(1, _reshard_and_set, path, 3)[0]
    assert out["state_dtypes"] == {torch.bfloat16}
    for name in straight["master"]:
        assert torch.equal(out["loaded"][name], resumed["loaded"][name]), name
        assert torch.equal(out["exp_avg"][name], resumed["loaded"][f"exp_avg {name}"]), name
    assert torch.equal(out["set"], torch.full_like(out["set"], 1.0))  # 1 + 2**-10 rounds to 1 in bf16


def _load_into_fp32_masters(path):
    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param

    torch.manual_seed(1)
    model = MLP()
    engine, opt, _, _ = zero_ext.initialize(model=model, model_parameters=_groups(model),
                                            config=_config(2, False, False, master=False))
    engine.load_checkpoint(path, tag="t")
    out = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    dtypes = {g.master.dtype for g in opt.flat_groups}
    engine.backward(engine.module.loss(_batch(0, 0, torch.distributed.get_rank())))
    engine.step()  # (the loaded bf16 moments serve the fp32 optimizer)
    engine.destroy()
    return out, dtypes


def test_bf16_master_checkpoint_loads_into_fp32_masters(tmp_path):
    path = str(tmp_path)
    run_ranks(2, _checkpoint, 2, True, False, path, False)
    resumed = run_ranks(2, _checkpoint, 2, True, False, path, True)[0]
    out, dtypes = run_ranks(2, _load_into_fp32_masters, path)[0]
    assert dtypes == {torch.float32}
    for name, value in out.items():
        assert torch.equal(value, resumed["loaded"][name]), name
