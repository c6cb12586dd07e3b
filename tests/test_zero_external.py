"""External parameters: used in the forward of a module that does not own them.

Detected automatically (zero_ext.zero.external, [Note: detecting external parameters]) or registered by
hand; either way forward and gradients must equal a plain model's bit for bit.
"""
import pytest
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.models import TinyGPT
from helpers.zero3 import grads, rank, same_tensors


class TiedLM(nn.Module):
    """DeepSpeed's example: the embedding weight is used again for the logits, in the root's forward."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)

    def forward(self, idx):
        h = torch.tanh(self.body(self.embeddings(idx)))
        return h @ self.embeddings.weight.t()


class BiasReturningLinear(nn.Linear):
    """DeepSpeed's example: returns its bias for the caller to add."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight), self.bias


class ReturnsParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = BiasReturningLinear(4, 3)
        self.post = nn.Linear(3, 3)

    def forward(self, x):
        y, bias = self.inner(x)
        return self.post(y + bias)


def _batch(name, gen):
    if name == "tied":
        return torch.randint(0, 11, (4, 5), generator=gen)
    if name == "gpt":
        return TinyGPT.batch(2, gen)
    return torch.randn(3, 4, generator=gen)


def _loss(name, model, batch):
    if name == "gpt":
        return model.loss(batch)
    return model(batch).pow(2).mean()


def _auto(name):
    import zero_ext.zero as zero
    from zero_ext.zero.external import external_parameters

    make = {"tied": TiedLM, "returns": ReturnsParam, "gpt": TinyGPT}[name]
    torch.manual_seed(3)
    ref = make()
    torch.manual_seed(3 + 100 * rank())
    with zero.Init():
        model = make()
    zm = zero.ZeroModel(model, param_persistence_threshold=0)
    gen = torch.Generator().manual_seed(rank())
    losses_equal = []
    for _ in range(2):
        batch = _batch(name, gen)
        a, b = _loss(name, ref, batch), _loss(name, model, batch)
        losses_equal.append(torch.equal(a, b))
        a.backward()
        b.backward()
    names = {id(p): n for n, p in model.named_parameters()}
    external = {m_name or "<root>": sorted(names[id(p)] for p in external_parameters(m))
                for m_name, m in model.named_modules() if external_parameters(m)}
    gathered = [n for n, p in model.named_parameters() if p.numel()]
    zm.destroy()
    return losses_equal, same_tensors(grads(ref), grads(model)), external, gathered


@pytest.mark.parametrize("name,world", [("tied", 2), ("returns", 2), ("gpt", 1)])
def test_external_parameters_are_detected(name, world):
    for losses_equal, grads_differ, external, gathered in run_ranks(world, _auto, name):
        assert all(losses_equal) and grads_differ == [] and gathered == []
        if name == "tied":
            assert external == {"<root>": ["embeddings.weight"]}
        elif name == "returns":
            assert external == {"<root>": ["inner.bias"]}
        else:  # MultiheadAttention passes its child out_proj's weight (no bias here) to F.multi_head_attention_forward
            for i in range(2):
                assert external[f"blocks.layers.{i}.self_attn"] == [f"blocks.layers.{i}.self_attn.out_proj.weight"]


def _manual():
    import zero_ext.zero as zero

    torch.manual_seed(3)
    ref = TiedLM()
    torch.manual_seed(3)
    with zero.Init():
        model = TiedLM()
    zm = zero.ZeroModel(model, param_persistence_threshold=0, detect_external_params=False)
    batch = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank()))
    try:
        model(batch)
        unregistered = "no error"
    except RuntimeError as exc:  # the logits saw the partitioned (empty) weight
        unregistered = type(exc).__name__
    zero.register_external_parameter(model, model.embeddings.weight)
    a, b = ref(batch).pow(2).mean(), model(batch).pow(2).mean()
    a.backward()
    b.backward()
    zero.unregister_external_parameter(model, model.embeddings.weight)
    errors = []
    for call in (lambda: zero.register_external_parameter(model, torch.zeros(2)),
                 lambda: zero.unregister_external_parameter(model, model.body.weight),
                 lambda: zero.unregister_external_parameter(model, torch.zeros(2))):
        try:
            call()
            errors.append("")
        except RuntimeError as exc:
            errors.append(str(exc))
    zm.destroy()
    return unregistered, torch.equal(a, b), same_tensors(grads(ref), grads(model)), errors


def test_register_and_unregister_by_hand():
    for unregistered, loss_equal, grads_differ, errors in run_ranks(2, _manual):
        assert unregistered == "RuntimeError"
        assert loss_equal and grads_differ == []
        assert "torch.nn.Parameter" in errors[0] and "not registered" in errors[1]
        assert "torch.nn.Parameter" in errors[2]


class PassesBiasOn(nn.Module):
    """Returns the bias its child returned, unused: the module that uses it is the one above."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = BiasReturningLinear(4, 3)
        self.seen = []

    def forward(self, x):
        y, bias = self.inner(self.pre(x))
        if hasattr(bias, "ds_status"):  # (the reference model's is a plain parameter)
            self.seen.append(bias.ds_status.name)  # the caller may read it: still gathered
        return y, bias


class AddsHandedUpBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.mid = PassesBiasOn()
        self.post = nn.Linear(3, 2)

    def forward(self, x):
        y, bias = self.mid(x)
        return self.post(torch.tanh(y + bias))


def _handed_up():
    import zero_ext.zero as zero

    torch.manual_seed(5)
    ref = AddsHandedUpBias()
    with zero.Init():
        model = AddsHandedUpBias()
    zm = zero.ZeroModel(model, param_persistence_threshold=0)
    with zero.GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.copy_(q)
    gen = torch.Generator().manual_seed(rank())
    holders = []
    for _ in range(3):
        x = torch.randn(5, 4, generator=gen)
        a, b = ref(x).pow(2).mean(), model(x).pow(2).mean()
        a.backward()
        b.backward()
        holders.append({n or "<root>": len(m._external_params) for n, m in model.named_modules()
                        if m._external_params})
    bias = model.mid.inner.bias
    registered_at_root = model._external_params.get(id(bias)) is bias
    zm.destroy()
    return model.mid.seen, holders, registered_at_root, same_tensors(grads(ref), grads(model))


def test_a_returned_parameter_stays_gathered_for_the_module_that_uses_it():
    for seen, holders, registered_at_root, grads_differ in run_ranks(2, _handed_up):
        assert seen == ["AVAILABLE"] * 3  # also in the first step, before any registration
        assert holders == [{"<root>": 1}] * 3  # handed up twice, to the module that adds it; not moved again
        assert registered_at_root and grads_differ == []
