"""ZeRO-3 fetch/release hooks (zero_ext.zero.ZeroModel) against a plain PyTorch model.

Each rank builds the reference under seed 7 and the ZeRO-3 model under zero.Init with its own seed
(7 + 100 * rank: Init must give every rank rank 0's model), runs the same rank-local batches through
both, and compares: losses bit-exact (fp32 forward is the same computation on the same values) and
the full gradients left on the parameters bit-exact (no gradient partitioning yet: each rank keeps
its local gradient, the reducer comes with the stage 3 optimizer). Also: statuses inside and after
forward, no_grad/eval forwards, persistence thresholds, the gradient-ready hook, exceptions, destroy.
"""
import pytest
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.models import MLP, TinyGPT
from helpers.zero3 import Containers, Deep, Shared, full_values, grads, rank, same_tensors

STEPS = 2


def _build(name):
    return {"mlp": MLP, "gpt": TinyGPT, "deep": Deep, "containers": Containers, "shared": Shared}[name]()


def _batch(name, gen):
    if name in ("mlp", "gpt"):
        return {"mlp": MLP, "gpt": TinyGPT}[name].batch(3, gen)
    return torch.randn(3, 5 if name == "deep" else 4, generator=gen)


def _loss(name, model, batch):
    if name in ("mlp", "gpt", "containers"):
        return model.loss(batch)
    return model(batch).pow(2).mean()


def _pair(name, **zero_model_kwargs):
    import zero_ext.zero as zero

    torch.manual_seed(7)
    ref = _build(name)
    torch.manual_seed(7 + 100 * rank())
    with zero.Init():
        model = _build(name)
    zm = zero.ZeroModel(model, **zero_model_kwargs)
    return ref, model, zm


def _parity(name, persistence):
    import zero_ext.zero as zero

    ref, model, zm = _pair(name, param_persistence_threshold=persistence)
    gen = torch.Generator().manual_seed(1000 + rank())
    result = {"losses_differ": [], "not_partitioned": []}
    for _ in range(STEPS):
        batch = _batch(name, gen)
        loss_ref, loss = _loss(name, ref, batch), _loss(name, model, batch)
        if not torch.equal(loss_ref, loss):
            result["losses_differ"].append((loss_ref.item(), loss.item()))
        loss_ref.backward()
        loss.backward()
        result["not_partitioned"] += [zp.name for zp in zm.params if not zp.persist
                                      and zp.param.ds_status is not zero.ZeroParamStatus.NOT_AVAILABLE]
    result["grads_differ"] = same_tensors(grads(ref), grads(model))
    result["values_differ"] = same_tensors({n: p.detach() for n, p in ref.named_parameters()}, full_values(model))
    result["persistent"] = sorted(zp.name for zp in zm.params if zp.param.ds_persist)
    result["held_after"] = [zp.name for zp in zm.params if zp.holders and not zp.persist]
    zm.destroy()
    return result


CASES = [("mlp", 1, 0), ("mlp", 2, 20), ("gpt", 2, 0), ("gpt", 4, 0), ("deep", 4, 0), ("deep", 1, 10),
         ("containers", 2, 0), ("shared", 2, 0)]


@pytest.mark.parametrize("name,world,persistence", CASES, ids=[f"{n}-n{w}-persist{p}" for n, w, p in CASES])
def test_forward_and_gradients_match_plain_pytorch(name, world, persistence):
    for r, res in enumerate(run_ranks(world, _parity, name, persistence)):
        assert res["losses_differ"] == [], f"rank {r}"
        assert res["grads_differ"] == [], f"rank {r}"
        assert res["values_differ"] == [], f"rank {r}"
        assert res["not_partitioned"] == [], f"rank {r}: still gathered after backward"
        assert res["held_after"] == [], f"rank {r}: holds left after backward"
        if persistence:
            assert res["persistent"], "a threshold above the smallest parameter makes some persistent"
        else:
            assert res["persistent"] == []


# -- statuses --------------------------------------------------------------------------------------------

class Probe(nn.Module):
    """x * weight, recording during forward the statuses of its own and of its siblings' weights."""

    def __init__(self, log, others):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 5))
        self.log, self.others = log, others

    def forward(self, x):
        self.log.append((self.weight.ds_status.name, tuple(self.weight.shape),
                         [o.weight.ds_status.name for o in self.others if o is not self]))
        return x * self.weight


def _statuses():
    import zero_ext.zero as zero

    log, layers = [], []
    with zero.Init():
        model = nn.Sequential(*[Probe(log, layers) for _ in range(3)])
    layers.extend(model)
    zm = zero.ZeroModel(model, param_persistence_threshold=0)
    before = [p.ds_status.name for p in model.parameters()]
    loss = model(torch.ones(3, 5)).sum()
    after_forward = [p.ds_status.name for p in model.parameters()]
    loss.backward()
    after_backward = [p.ds_status.name for p in model.parameters()]
    shapes = [tuple(p.shape) for p in model.parameters()] + [tuple(p.grad.shape) for p in model.parameters()]
    zm.destroy()
    return before, log, after_forward, after_backward, shapes


def test_statuses_inside_and_after_forward():
    for before, log, after_forward, after_backward, shapes in run_ranks(2, _statuses):
        assert before == after_forward == after_backward == ["NOT_AVAILABLE"] * 3
        assert log == [("AVAILABLE", (3, 5), ["NOT_AVAILABLE"] * 2)] * 3
        assert shapes == [(0,)] * 3 + [(3, 5)] * 3  # partitioned data, full gradients left on the parameter


def _no_grad_eval(name):
    import zero_ext.zero as zero

    ref, model, zm = _pair(name, param_persistence_threshold=0)
    ref.eval()
    model.eval()
    gen = torch.Generator().manual_seed(3 + rank())
    batch = _batch(name, gen)
    x = batch[0] if isinstance(batch, tuple) else batch
    with torch.no_grad():
        out_ref, out = ref(x), model(x)
    result = {
        "equal": torch.equal(out_ref, out),
        "grad_fn": out.grad_fn is not None,
        "gathered": [zp.name for zp in zm.params if zp.param.ds_status is not zero.ZeroParamStatus.NOT_AVAILABLE],
        "held": [zp.name for zp in zm.params if zp.holders],
        "mode_stack": torch._C._len_torch_function_stack(),
    }
    # grad mode on in eval: the machinery runs and the gradients still match
    ref(x).float().pow(2).mean().backward()
    model(x).float().pow(2).mean().backward()
    result["grads_differ"] = same_tensors(grads(ref), grads(model))
    zm.destroy()
    return result


@pytest.mark.parametrize("name,world", [("gpt", 2), ("mlp", 1)])
def test_no_grad_eval_forward_fetches_and_releases_without_autograd(name, world):
    for res in run_ranks(world, _no_grad_eval, name):
        assert res["equal"] and not res["grad_fn"]
        assert res["gathered"] == [] and res["held"] == [] and res["mode_stack"] == 0
        assert res["grads_differ"] == []


# -- persistence, the engine's hook points, exceptions, destroy ------------------------------------------

def _persistence():
    import zero_ext.zero as zero

    with zero.Init():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))  # 16,4, 8,2, 4,2 elements
    zm = zero.ZeroModel(model, param_persistence_threshold=8, model_persistence_threshold=14)
    persistent = [n for n, p in model.named_parameters() if p.ds_persist]
    model(torch.randn(2, 4)).sum().backward()
    available = [n for n, p in model.named_parameters() if p.ds_status is zero.ZeroParamStatus.AVAILABLE]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    zm.release_all()
    after_release = [n for n, p in model.named_parameters() if p.numel()]
    with torch.no_grad():  # (with autograd on, what the backward uses next would stay gathered for it)
        model(torch.randn(2, 4))  # persistent parameters come back on their next use and stay
    back = [n for n, p in model.named_parameters() if p.numel()]
    zm.destroy()
    return persistent, available, shapes, after_release, back, [p.ds_persist for p in model.parameters()]


def test_persistence_thresholds():
    for persistent, available, shapes, after_release, back, flags in run_ranks(2, _persistence):
        # <= 8 elements each, in model order, while the total stays <= 14: 0.bias(4), 1.weight(8), 1.bias(2)
        assert persistent == ["0.bias", "1.weight", "1.bias"]
        assert available == persistent
        assert shapes["1.weight"] == (2, 4) and shapes["0.weight"] == (0,)
        assert after_release == [] and back == persistent
        assert flags == [False] * 6


def _grad_ready_hook():
    import zero_ext.zero as zero

    with zero.Init():
        model = MLP()
    zm = zero.ZeroModel(model, param_persistence_threshold=0)
    seen, ends = [], []
    handle = zm.register_grad_ready_hook(lambda zp: seen.append((zp.name, tuple(zp.param.grad.shape))))
    zm.register_backward_end_hook(lambda: ends.append(len(seen)))
    gen = torch.Generator().manual_seed(rank())
    model.loss(MLP.batch(2, gen)).backward()
    first = list(seen)
    handle.remove()
    model.loss(MLP.batch(2, gen)).backward()
    zm.destroy()
    return first, len(seen), ends, {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}


def test_grad_ready_hook_sees_each_full_gradient_once():
    for first, total, ends, shapes in run_ranks(2, _grad_ready_hook):
        assert sorted(first) == sorted((n, s) for n, s in {
            "body.weight": (13, 13), "body.bias": (13,), "head.weight": (5, 13), "head.bias": (5,)}.items())
        assert total == len(first)  # removed: not called again
        assert ends == [4, 4]  # end-of-backward hook ran after every gradient, each backward
        assert set(shapes.values()) == {(0,)}


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.fail = True

    def forward(self, x):
        y = self.lin(x)
        if self.fail:
            raise ValueError("boom")
        return y


def _exception_unwinds():
    import zero_ext.zero as zero

    with zero.Init():
        model = nn.Sequential(nn.Linear(3, 3), Boom())
    zm = zero.ZeroModel(model, param_persistence_threshold=0)
    try:
        model(torch.randn(2, 3))
        raised = False
    except ValueError:
        raised = True
    state = ([n for n, p in model.named_parameters() if p.numel()], torch._C._len_torch_function_stack(),
             zm.top() is None)
    model[1].fail = False
    model(torch.randn(2, 3)).sum().backward()
    ok = all(p.grad is not None and p.numel() == 0 for p in model.parameters())
    zm.destroy()
    hooks_left = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return raised, state, ok, hooks_left, [p.ds_status.name for p in model.parameters()]


def test_exception_in_forward_releases_and_unwinds_then_destroy():
    raised, (gathered, modes, stack_empty), ok, hooks_left, statuses = run_ranks(2, _exception_unwinds)[0]
    assert raised and gathered == [] and modes == 0 and stack_empty
    assert ok and hooks_left == 0 and statuses == ["NOT_AVAILABLE"] * 4


def _twice_installed():
    import zero_ext.zero as zero

    model = nn.Linear(3, 3)
    zm = zero.ZeroModel(model)  # a model built without zero.Init is partitioned here
    converted = zero.is_zero_param(model.weight)
    try:
        zero.ZeroModel(model)
        message = ""
    except RuntimeError as exc:
        message = str(exc)
    zm.destroy()
    return converted, message


def test_model_built_without_init_is_partitioned_and_installing_twice_is_refused():
    converted, message = run_ranks(1, _twice_installed)[0]
    assert converted and "already installed" in message
