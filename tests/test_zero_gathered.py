"""GatheredParameters: gather on enter, partition on exit, modifier_rank broadcast, pass-through."""
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.zero3 import full_values, rank


def _modifier():
    import zero_ext.zero as zero

    torch.manual_seed(0)
    with zero.Init():
        lin = nn.Linear(4, 2)
    original = full_values(lin)
    updates = []
    zero.zero_param_of(lin.weight).register_update_hook(lambda zp: updates.append(zp.name))
    out = {}
    with zero.GatheredParameters(lin.weight, modifier_rank=1):
        out["inside"] = (lin.weight.ds_status.name, lin.weight.numel())
        if rank() == 1:
            lin.weight.data.zero_()
    out["after"] = (lin.weight.ds_status.name, lin.weight.numel(), lin.weight.ds_tensor.tolist())
    out["zeroed"] = torch.equal(full_values(lin)["weight"], torch.zeros(2, 4))
    with zero.GatheredParameters((p for p in lin.parameters())):  # a generator; modifier_rank=None
        lin.bias.data.fill_(5.0)
        with torch.no_grad():
            lin.weight.add_(1.0)
    out["discarded"] = torch.equal(full_values(lin)["bias"], original["bias"]) and torch.equal(
        full_values(lin)["weight"], torch.zeros(2, 4))
    with zero.GatheredParameters([lin.bias], modifier_rank=0):
        lin.bias.data = torch.full((2,), 3.0 + rank())  # replaced, not written into
    out["replaced"] = full_values(lin)["bias"].tolist()
    out["updates"] = list(updates)
    return out


def test_modifier_rank_broadcasts_and_none_discards():
    for out in run_ranks(2, _modifier):
        assert out["inside"] == ("AVAILABLE", 8)
        assert out["after"] == ("NOT_AVAILABLE", 0, [0.0] * 4)
        assert out["zeroed"] and out["discarded"]
        assert out["replaced"] == [3.0, 3.0]  # rank 0's replacement wins
        assert len(out["updates"]) == 1  # the weight was written back once (modifier_rank=1)


def _pass_through_and_nesting():
    import zero_ext.zero as zero

    plain = nn.Linear(2, 2)
    before = plain.weight.detach().clone()
    out = {}
    if rank() == 0:  # no ZeRO-3 parameter: no collective, so one rank alone is fine
        with zero.GatheredParameters([plain.weight, torch.ones(3)], modifier_rank=0):
            plain.weight.data.add_(1)
    out["plain"] = torch.equal(plain.weight, before + (1 if rank() == 0 else 0))
    with zero.Init():
        a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    with zero.GatheredParameters(a.weight, enabled=False):
        out["disabled"] = a.weight.numel()
    with zero.GatheredParameters(a.weight):
        with zero.GatheredParameters(b.weight):  # different parameters: fine
            out["nested"] = (a.weight.numel(), b.weight.numel())
        try:
            with zero.GatheredParameters([b.weight, a.weight]):
                pass
            out["overlap"] = ""
        except RuntimeError as exc:
            out["overlap"] = str(exc)
    out["after"] = (a.weight.numel(), b.weight.numel())
    try:
        with zero.GatheredParameters(a.bias, modifier_rank=0):
            a.bias.data.fill_(2.0)
            raise ValueError("inside")
    except ValueError:
        pass
    out["after_exception"] = (a.bias.numel(), full_values(a)["bias"].tolist())
    return out


def test_pass_through_nesting_and_exceptions():
    for out in run_ranks(2, _pass_through_and_nesting):
        assert out["plain"] and out["disabled"] == 0
        assert out["nested"] == (9, 9)
        assert "cannot overlap" in out["overlap"]
        assert out["after"] == (0, 0)
        assert out["after_exception"] == (0, [2.0, 2.0, 2.0])


def _inside_forward():
    import zero_ext.zero as zero

    class Peek(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 3))
            self.other = nn.Linear(3, 3)

        def forward(self, x):
            with zero.GatheredParameters([self.weight, self.other.weight]):
                pass
            # the weight is still held by this module's call, so it stays gathered; `other`'s is not
            return x @ self.weight, (self.weight.numel(), self.other.weight.numel())

    with zero.Init():
        model = nn.Sequential(nn.Identity(), Peek())
    zm = zero.ZeroModel(model, param_persistence_threshold=0, detect_external_params=False)
    _, sizes = model[1](torch.randn(2, 3))
    fwd = zero.GatheredParameters(model[1].other.weight, fwd_module=model[1])
    from zero_ext.zero.external import external_parameters
    registered = [p is model[1].other.weight for p in external_parameters(model[1])]
    zero.unregister_external_parameter(model[1], model[1].other.weight)
    zm.destroy()
    return sizes, registered, len(fwd.params)


def test_inside_a_forward_and_fwd_module():
    sizes, registered, count = run_ranks(2, _inside_forward)[0]
    assert sizes == (9, 0)
    assert registered == [True] and count == 1


def _under_init_dtype():
    import zero_ext.zero as zero

    torch.manual_seed(0)
    expected = nn.Linear(5, 5).weight.detach().clone()
    torch.manual_seed(0)
    with zero.Init():
        lin = nn.Linear(5, 5)  # fp32, never gathered yet
    with zero.Init(dtype=torch.bfloat16):  # zero_ext's own buffers are not cast to Init's dtype
        with zero.GatheredParameters(lin.weight):
            inside = lin.weight.detach().clone()
    return inside.dtype, torch.equal(inside, expected)


def test_gathering_inside_an_init_with_another_dtype_is_exact():
    for dtype, equal in run_ranks(2, _under_init_dtype):
        assert dtype == torch.float32 and equal


def _sanity_checked(via_engine, modifier):
    import zero_ext
    import zero_ext.zero as zero

    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "enable_sanity_checks": True, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    if via_engine:
        lin = nn.Linear(4, 2)
        engine = zero_ext.initialize(model=lin, config=config)[0]
    else:
        with zero.Init(config_dict_or_path=config):
            lin = nn.Linear(4, 2)
    before = full_values(lin)
    outcome = "no error"
    try:
        with zero.GatheredParameters(list(lin.parameters())):
            if rank() == modifier:
                with torch.no_grad():
                    lin.weight.mul_(2.0)
    except RuntimeError as exc:
        outcome = str(exc)
    unchanged = all(torch.equal(v, before[k]) for k, v in full_values(lin).items())
    with zero.GatheredParameters(list(lin.parameters())):  # reading only: no error
        lin.weight.sum()
    if via_engine:
        engine.destroy()
    return outcome, unchanged


def test_sanity_checks_turn_a_discarded_change_into_an_error_on_every_rank():
    for via_engine in (False, True):
        for outcome, unchanged in run_ranks(2, _sanity_checked, via_engine, 1):  # rank 1 alone modifies
            assert "in-place modification" in outcome and "modifier_rank=<rank>" in outcome
            assert unchanged  # (discarded all the same)
    for outcome, unchanged in run_ranks(2, _sanity_checked, False, -1):  # nobody modifies
        assert outcome == "no error" and unchanged
