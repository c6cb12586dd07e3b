"""ZeRO-3 parameters of several dtypes in one model, as DeepSpeed allows: a bf16 base built under zero.Init
and fp32 LoRA-style adapters added afterwards with ``param.convert_to_zero_parameters``. Each keeps its
dtype through initialize, forward, backward, step and a checkpoint round trip; training matches a plain
single-process PyTorch run with fp32 masters; a model built entirely in a dtype the config does not
train in is still refused, unless it was built under a zero.Init that named no dtype (DeepSpeed's
`with zero.Init():`): then initialize recasts it to the training dtype. 2 gloo ranks."""
import pytest
import torch
import torch.nn.functional as F

from helpers.harness import RankFailed, run_ranks

H, R, STEPS, LR = 8, 4, 3, 1e-2


def _config(stage3_extra=None):
    zc = {"stage": 3, "stage3_param_persistence_threshold": 0}
    zc.update(stage3_extra or {})
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": zc}


class Adapted(torch.nn.Module):
    """y = base x + b (a x) / R: the base in the model's dtype, the adapters in fp32."""

    def __init__(self, train_base: bool):
        super().__init__()
        self.base = torch.nn.Parameter(torch.randn(H, H) * 0.1, requires_grad=train_base)

    def attach(self, zero: bool) -> None:
        g = torch.Generator().manual_seed(1)
        self.a = torch.nn.Parameter(torch.randn(R, H, generator=g) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(H, R, generator=g) * 0.1)
        if zero:
            self.base.convert_to_zero_parameters([self.a, self.b])

    def forward(self, x, target):
        y = F.linear(x.to(self.base.dtype), self.base).float() + F.linear(F.linear(x, self.a), self.b) / R
        return F.mse_loss(y, target)


def _batches(rank: int, world: int):
    g = torch.Generator().manual_seed(7)
    full = [(torch.randn(2 * world, H, generator=g), torch.randn(2 * world, H, generator=g)) for _ in range(STEPS)]
    return full, [(x[2 * rank:2 * rank + 2], t[2 * rank:2 * rank + 2]) for x, t in full]


def _dtypes(model):
    return {n: (p.dtype, p.ds_tensor.dtype) for n, p in model.named_parameters()}


def _build(train_base: bool, config):
    import zero_ext

    torch.manual_seed(0)
    with zero_ext.zero.Init(config_dict_or_path=config):
        model = Adapted(train_base)
    model.attach(zero=True)
    params = [p for p in model.parameters() if p.requires_grad]
    engine = zero_ext.initialize(model=model, model_parameters=params, config=config,
                                 optimizer=torch.optim.AdamW(params, lr=LR, weight_decay=0.0))[0]
    return engine


def _reference(train_base: bool, world: int):
    """Plain PyTorch on the whole batch: the base trains through an fp32 master rounded to bf16 after
    each step, the adapters are fp32 parameters."""
    torch.manual_seed(0)
    ref = Adapted(train_base)
    ref.attach(zero=False)
    torch.manual_seed(0)  # zero.Init made the base in bf16 from the start: randn cast, then scaled in bf16
    ref.base.data = torch.randn(H, H).to(torch.bfloat16) * 0.1
    master = ref.base.detach().float()
    masters = ([master] if train_base else []) + [ref.a, ref.b]
    master.requires_grad_(train_base)
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.0)
    losses = []
    for x, t in _batches(0, world)[0]:
        loss = ref(x, t)
        loss.backward()
        if train_base:
            master.grad = ref.base.grad.float()
            ref.base.grad = None
        opt.step()
        opt.zero_grad()
        ref.base.data = master.detach().to(torch.bfloat16)
        losses.append(loss.item())
    return losses, {"base": ref.base.detach().float(), "a": ref.a.detach(), "b": ref.b.detach()}


def _train(train_base: bool, bf16_masters: bool = False):
    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param, safe_get_full_grad

    rank, world = zero_ext.comm.get_rank(), zero_ext.comm.get_world_size()
    config = _config()
    if bf16_masters:
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    engine = _build(train_base, config)
    out = {"built": _dtypes(engine.module)}
    losses = []
    for i, (x, t) in enumerate(_batches(rank, world)[1]):
        loss = engine(x, t)
        engine.backward(loss)
        if i == 0:
            grad = safe_get_full_grad(engine.module.a)
            out["grad"] = (grad.dtype, bool(torch.count_nonzero(grad) > 0))
        engine.step()
        losses.append(_mean(loss))
    out["trained"] = _dtypes(engine.module)
    out["losses"] = losses
    out["params"] = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    with zero_ext.zero.GatheredParameters([engine.module.base]):
        out["params"].setdefault("base", engine.module.base.detach().float().clone())
    out["reference"] = _reference(train_base, world)
    engine.destroy()
    return out


def _mean(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    t = loss.detach().float().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@pytest.mark.parametrize("train_base", [False, True], ids=["frozen-base", "trained-base"])
def test_mixed_dtypes_train_like_pytorch(train_base):
    results = run_ranks(2, _train, train_base)
    bf16, fp32 = torch.bfloat16, torch.float32
    want = {"base": (bf16, bf16), "a": (fp32, fp32), "b": (fp32, fp32)}
    for out in results:
        assert out["built"] == want and out["trained"] == want
        assert out["grad"] == (fp32, True)
    ref_losses, ref_params = results[0]["reference"]
    # the forward is the same computation on the same values: the losses agree to fp32 rounding while the
    # base is frozen; a trained base is rounded to bf16 after each step on both sides, and its gradient
    # is averaged in bf16 here: 1e-3 relative
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-5 if not train_base else 1e-3)
    assert results[0]["losses"] == results[1]["losses"]
    for name, value in ref_params.items():
        got = results[0]["params"][name]
        assert torch.equal(got, results[1]["params"][name])
        tol = 1e-6 if not train_base else 2e-3  # bf16 rounding of the averaged base gradient
        assert torch.allclose(got, value, atol=tol, rtol=0), (name, (got - value).abs().max())


def _converted_like_owner():
    import zero_ext

    rank = zero_ext.comm.get_rank()
    config = _config({"offload_param": {"device": "cpu"}})
    torch.manual_seed(0)
    with zero_ext.zero.Init(config_dict_or_path=config):
        model = Adapted(train_base=False)
    extra = torch.nn.Parameter(torch.full((3, 5), float(rank + 1)))  # rank 0's value wins
    model.base.convert_to_zero_parameters([extra, model.base])  # an already partitioned one is skipped
    with zero_ext.zero.GatheredParameters([extra]):
        value = extra.detach().clone()
    return {"value": value, "dtype": extra.dtype, "status": extra.ds_status.name,
            "where": extra.ds_tensor.device.type, "same_place": extra.ds_tensor.device == model.base.ds_tensor.device,
            "piece": tuple(extra.ds_tensor.shape), "group": extra.ds_process_group is model.base.ds_process_group}


def test_convert_to_zero_parameters_partitions_like_its_owner():
    for out in run_ranks(2, _converted_like_owner):
        assert torch.equal(out["value"], torch.full((3, 5), 1.0))
        assert out["dtype"] == torch.float32 and out["status"] == "NOT_AVAILABLE"
        assert out["same_place"] and out["where"] == "cpu" and out["piece"] == (8,) and out["group"]


def _all_in_wrong_dtype():
    import zero_ext

    with zero_ext.zero.Init(dtype=torch.float32):
        model = Adapted(train_base=True)
    zero_ext.initialize(model=model, model_parameters=model.parameters(), config=_config(),
                        optimizer=torch.optim.AdamW(model.parameters(), lr=LR))


def test_a_model_built_entirely_in_another_dtype_is_refused():
    with pytest.raises(RankFailed, match=r"built under zero.Init as torch.float32, but the config trains in "
                                         r"torch.bfloat16"):
        run_ranks(2, _all_in_wrong_dtype)


def _checkpoint_round_trip(tmp):
    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param

    engine = _build(True, _config())
    rank, world = zero_ext.comm.get_rank(), zero_ext.comm.get_world_size()
    for x, t in _batches(rank, world)[1][:2]:
        engine.backward(engine(x, t))
        engine.step()
    engine.save_checkpoint(tmp, tag="t")
    saved = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    engine.destroy()
    again = _build(True, _config())
    again.load_checkpoint(tmp, tag="t")
    loaded = {n: safe_get_full_fp32_param(p) for n, p in again.module.named_parameters()}
    x, t = _batches(rank, world)[1][2]
    return {"same": all(torch.equal(saved[n], loaded[n]) for n in saved), "dtypes": _dtypes(again.module),
            "loss": _mean(again(x, t))}


def test_checkpoint_round_trip_keeps_each_dtype(tmp_path):
    out = run_ranks(2, _checkpoint_round_trip, str(tmp_path))
    for o in out:
        assert o["same"]
        assert o["dtypes"]["a"] == (torch.float32, torch.float32)
        assert o["dtypes"]["base"] == (torch.bfloat16, torch.bfloat16)
    assert out[0]["loss"] == out[1]["loss"]


def test_fp32_adapters_keep_fp32_masters_when_the_bf16_model_has_bf16_masters():
    """bf16_master_weights_and_grads is for the 16-bit parameters: the fp32 adapters of a frozen bf16 base
    train exactly as in fp32 (a bf16 master would round every update)."""
    results = run_ranks(2, _train, False, True)
    ref_losses, ref_params = results[0]["reference"]
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    for name in ("a", "b"):
        assert torch.allclose(results[0]["params"][name], ref_params[name], atol=1e-6, rtol=0), name


def _bare_init_then(precision):
    """DeepSpeed's pattern: ``with zero.Init():`` (no config, no dtype), then a 16-bit config. The pieces take
    the config's dtype at initialize, rounded from the values built in torch's default dtype."""
    import zero_ext
    from helpers.models import MLP

    torch.manual_seed(0)
    plain = MLP()
    torch.manual_seed(0)
    with zero_ext.zero.Init():
        model = MLP()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    engine, *_ = zero_ext.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, precision: {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    pieces = {p.ds_tensor.dtype for p in model.parameters()}
    with zero_ext.zero.GatheredParameters(list(model.parameters())):
        exact = all(torch.equal(p, q.to(dtype)) for p, q in zip(model.parameters(), plain.parameters()))
    x, y = MLP.batch(2, torch.Generator().manual_seed(1), dtype)
    loss = engine.module.loss((x, y))
    engine.backward(loss)
    engine.step()
    engine.destroy()
    return pieces, exact, bool(torch.isfinite(loss)), engine.global_steps


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_model_built_under_a_bare_init_takes_the_configs_dtype(precision):
    want = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    for pieces, exact, finite, steps in run_ranks(2, _bare_init_then, precision):
        assert pieces == {want} and exact and finite and steps == 1
