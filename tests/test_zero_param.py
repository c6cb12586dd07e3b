"""ZeroParam: the ds_* attributes third-party code reads, the pieces, the freed storage, deepcopy."""
import copy

import pytest
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.zero3 import full_values, rank, same_tensors


def test_deepspeed_names_and_values():
    import zero_ext.zero as zero
    from zero_ext.zero import utils

    assert [(s.name, s.value) for s in zero.ZeroParamStatus] == [("AVAILABLE", 1), ("NOT_AVAILABLE", 2),
                                                                  ("INFLIGHT", 3)]
    assert utils.ZeroParamStatus is zero.ZeroParamStatus and utils.is_zero_param is zero.is_zero_param
    for name in ("Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter"):
        assert callable(getattr(zero, name))
    assert not zero.is_zero_param(torch.zeros(2)) and not zero.is_zero_param(nn.Parameter(torch.zeros(2)))
    assert not zero.is_zero_param("ds_id")


def _layout(world):
    import zero_ext.zero as zero

    torch.manual_seed(100 * rank())
    with zero.Init():
        lin = nn.Linear(6, 3)  # 18 and 3 elements
        odd = nn.Parameter(torch.randn(7))
        holder = nn.Module()
        holder.odd = odd
    plain = nn.Linear(6, 3)
    w = lin.weight
    out = {
        "attrs": (w.ds_id >= 0, tuple(w.ds_shape), w.ds_numel, w.ds_status, tuple(w.shape), w.numel(),
                  w.ds_persist, w.ds_tensor.ds_numel, w.ds_process_group is None, w.requires_grad),
        "plain": hasattr(plain.weight, "ds_status"),
        "pieces": {n: p.ds_tensor.clone() for n, p in [("weight", w), ("bias", lin.bias), ("odd", odd)]},
        "full": {"weight": full_values(lin)["weight"], "bias": full_values(lin)["bias"],
                 "odd": full_values(holder)["odd"]},
        "summary": sorted(zero.zero_param_of(w).summary()),
    }
    with zero.GatheredParameters(w):
        out["gathered"] = (w.ds_status, tuple(w.shape), w.numel())
    out["released"] = (w.ds_status, w.numel())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_attributes_pieces_and_padding(world):
    import zero_ext.zero as zero

    results = run_ranks(world, _layout, world)
    for r, out in enumerate(results):
        assert out["attrs"] == (True, (3, 6), 18, zero.ZeroParamStatus.NOT_AVAILABLE, (0,), 0, False,
                                -(-18 // world), True, True)
        assert out["plain"] is False
        assert out["gathered"] == (zero.ZeroParamStatus.AVAILABLE, (3, 6), 18)
        assert out["released"] == (zero.ZeroParamStatus.NOT_AVAILABLE, 0)
        assert "ds_shape" in out["summary"] and "status" in out["summary"]
    for name in ("weight", "bias", "odd"):
        full = results[0]["full"][name].reshape(-1)
        joined = torch.cat([out["pieces"][name] for out in results])
        shard = results[0]["pieces"][name].numel()
        assert shard == -(-full.numel() // world)
        assert torch.equal(joined[: full.numel()], full)
        assert torch.equal(joined[full.numel():], torch.zeros(world * shard - full.numel())), "padding zeroed"
        for out in results:
            assert torch.equal(out["full"][name].reshape(-1), full), "every rank sees rank 0's value"


def _facade_is_read_only():
    import zero_ext.zero as zero

    with zero.Init():
        lin = nn.Linear(3, 3)
    lin.weight.ds_status = zero.ZeroParamStatus.AVAILABLE  # a foreign write
    try:
        with zero.GatheredParameters(lin.weight):
            pass
        return ""
    except RuntimeError as exc:
        return str(exc)


def test_facade_written_by_others_is_reported():
    message = run_ranks(1, _facade_is_read_only)[0]
    assert "read-only" in message and "GatheredParameters" in message


def _storage_freed():
    import zero_ext.zero as zero

    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    torch.manual_seed(0)
    with zero.Init():
        lin = nn.Linear(4, 3)
    zm = zero.ZeroModel(lin, param_persistence_threshold=0)
    x = torch.randn(2, 4, requires_grad=True)
    y = lin(x)
    saved = y.grad_fn._saved_mat2  # F.linear saves weight.t(), a view of the gathered storage
    freed = (tuple(saved.shape), saved.untyped_storage().nbytes())
    y.sum().backward()  # the pre-backward hook gathers into the same storage before the view is read
    ref(x.detach().requires_grad_()).sum().backward()
    zm.destroy()
    return freed, torch.equal(lin.weight.grad, ref.weight.grad)


def test_gathered_storage_is_freed_while_saved_views_survive():
    freed, grads_equal = run_ranks(2, _storage_freed)[0]
    assert freed == ((4, 3), 0)
    assert grads_equal


def _deepcopy():
    import zero_ext.zero as zero

    with zero.Init():
        src = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 2))
    dup = copy.deepcopy(src)
    same = same_tensors(full_values(src), full_values(dup))
    ids = {p.ds_id for p in src.parameters()} & {p.ds_id for p in dup.parameters()}
    with zero.GatheredParameters(dup[0].weight, modifier_rank=0):
        dup[0].weight.data.zero_()
    independent = not torch.equal(full_values(src)["0.weight"], full_values(dup)["0.weight"])
    return same, ids, independent, [p.ds_status.name for p in dup.parameters()]


def test_deepcopy_of_a_partitioned_model_copies_the_pieces():
    for same, ids, independent, statuses in run_ranks(2, _deepcopy):
        assert same == [] and ids == set() and independent
        assert statuses == ["NOT_AVAILABLE"] * 4
