"""The MoE layer (zero_ext/moe/layer.py) with expert parallelism, on real gloo ranks (helpers/harness.py).

Parity: every rank of an expert-parallel group holds only its experts and its own tokens; the reference
is one process holding all experts (ep_size 1) that runs every rank's tokens of the group. With no
dropped tokens (drop_tokens=False, or a capacity factor larger than any count) the output, the input
gradient, each expert's gradient (summed over the group's tokens) and the dense gradients (gate,
PR-MoE coefficient and mlp: summed over the group here, as the engine's all-reduce would) must agree
in fp32 to 1e-6 relative to each tensor's largest entry (max |a - b| <= 1e-6 max |b|): the sums run
in another order, so an entry that is a near-cancelling sum is only as exact as the tensor's scale.
"""
import pytest
import torch

from helpers.harness import run_ranks

HIDDEN = 8


def _expert():
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, 12), torch.nn.GELU(), torch.nn.Linear(12, HIDDEN))


def _layer(num_experts, ep_size, case):
    from zero_ext.moe import MoE

    torch.manual_seed(0)  # the same gate, experts and residual path on every rank
    return MoE(HIDDEN, _expert(), num_experts=num_experts, ep_size=ep_size, k=case["k"], min_capacity=0,
               capacity_factor=case.get("capacity_factor", 1.0), drop_tokens=case.get("drop_tokens", False),
               use_residual=case.get("use_residual", False), top2_2nd_expert_sampling=False, use_rts=True)


def _tokens(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(3, 5, HIDDEN, generator=g) * (1 + rank)  # the ranks route differently
    return x, torch.randn(3, 5, HIDDEN, generator=g)


def _close(got, want, what=""):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= 1e-6 * scale, f"{what}: max |diff| {err:.3g} > 1e-6 x max |ref| {scale:.3g}"


def _loss(layer, x, w):
    out, l_aux, counts = layer(x)
    return (out * w).sum() + 0.1 * l_aux, out, counts


def _parity(ep_size, num_experts, case):
    from zero_ext import comm
    from zero_ext.moe import groups

    rank, world = comm.get_rank(), comm.get_world_size()
    layer = _layer(num_experts, ep_size, case)
    full = _layer(num_experts, 1, case)  # the reference: all experts, same initial values
    local = num_experts // ep_size
    ep_rank = rank % ep_size
    with torch.no_grad():  # EP rank r's expert i is global expert r * local + i
        for i, mine in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            src = full.deepspeed_moe.experts.deepspeed_experts[ep_rank * local + i]
            for p, q in zip(mine.parameters(), src.parameters()):
                p.copy_(q)
    layer.set_deepspeed_parallelism()
    x, w = _tokens(rank)
    x.requires_grad_(True)
    loss, out, counts = _loss(layer, x, w)
    loss.backward()

    members = groups.expert_parallel_group_ranks(layer.expert_group_name)
    assert members == list(range(rank - ep_rank, rank - ep_rank + ep_size))
    ref_out = ref_xgrad = None
    for r in members:  # the reference sees every rank's tokens of the group
        xr, wr = _tokens(r)
        xr.requires_grad_(True)
        loss_r, out_r, counts_r = _loss(full, xr, wr)
        loss_r.backward()
        if r == rank:
            ref_out, ref_xgrad, ref_counts = out_r.detach(), xr.grad, counts_r

    _close(out.detach(), ref_out, "output")
    _close(x.grad, ref_xgrad, "input gradient")
    assert torch.equal(counts, ref_counts)
    for i, mine in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
        src = full.deepspeed_moe.experts.deepspeed_experts[ep_rank * local + i]
        for p, q in zip(mine.parameters(), src.parameters()):
            _close(p.grad, q.grad, f"local expert {i}")
    group = groups.expert_parallel_group(layer.expert_group_name)
    experts = {id(p) for p in layer.deepspeed_moe.experts.parameters()}
    dense = [(n, p) for n, p in layer.named_parameters() if id(p) not in experts]
    for (name, p), q in zip(dense, [full.get_parameter(n) for n, _ in dense]):
        summed = p.grad.clone()
        comm.all_reduce(summed, group=group)
        _close(summed, q.grad, name)
    return world


CASES = [  # (world, ep_size, num_experts, case)
    (2, 2, 4, {"k": 1}),
    (2, 2, 2, {"k": 2, "use_residual": True}),
    (4, 2, 4, {"k": 2, "use_residual": True}),
    (4, 4, 8, {"k": 1, "drop_tokens": True, "capacity_factor": 64.0}),  # drop path, nothing over capacity
    (4, 4, 4, {"k": 3}),
]


@pytest.mark.parametrize("world,ep_size,num_experts,case", CASES,
                         ids=[f"w{c[0]}-ep{c[1]}-e{c[2]}-k{c[3]['k']}" for c in CASES])
def test_expert_parallel_matches_one_process_with_all_experts(world, ep_size, num_experts, case):
    assert run_ranks(world, _parity, ep_size, num_experts, case, timeout=90) == [world] * world


def _before_groups():
    layer = _layer(4, 2, {"k": 1})
    try:
        layer(torch.randn(2, 4, HIDDEN))
    except RuntimeError as e:
        return str(e)
    return None


def _ep1_on_two_ranks():
    layer = _layer(2, 1, {"k": 1})
    out, _, _ = layer(torch.randn(2, 4, HIDDEN))  # works before set_deepspeed_parallelism
    layer.set_deepspeed_parallelism()
    out2, _, _ = layer(torch.randn(2, 4, HIDDEN))
    return tuple(out.shape), tuple(out2.shape)


def test_forward_before_the_groups_refuses_and_ep1_needs_none():
    messages = run_ranks(2, _before_groups, timeout=60)
    assert all(m is not None and "deepspeed.initialize" in m and "set_deepspeed_parallelism" in m for m in messages)
    assert run_ranks(2, _ep1_on_two_ranks, timeout=60) == [((2, 4, HIDDEN), (2, 4, HIDDEN))] * 2


def test_expert_marks_and_module_names():
    from zero_ext.moe import MoE

    layer = MoE(HIDDEN, _expert(), num_experts=4, ep_size=2, use_residual=True)
    assert layer.num_local_experts == 2 and layer.expert_group_name == "ep_size_2"
    assert layer.deepspeed_moe.ep_group is None and layer.deepspeed_moe.gate.wg.weight.shape == (4, HIDDEN)
    for name, p in layer.named_parameters():
        if name.startswith("deepspeed_moe.experts."):
            assert p.allreduce is False and p.group_name == "ep_size_2", name
        else:
            assert getattr(p, "allreduce", True) is True and not hasattr(p, "group_name"), name
    keys = set(layer.state_dict())
    assert {"deepspeed_moe.gate.wg.weight", "deepspeed_moe.experts.deepspeed_experts.1.2.bias",
            "mlp.0.weight", "coefficient.weight"} <= keys
    assert not any(k.startswith("deepspeed_moe.experts.deepspeed_experts.2.") for k in keys)


def test_construction_errors():
    from zero_ext.moe import MoE

    with pytest.raises(ValueError, match=r"num_experts \(3\).*ep_size \(2\)"):
        MoE(HIDDEN, _expert(), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        MoE(HIDDEN, _expert(), num_experts=2, noisy_gate_policy="Gauss")
    layer = MoE(HIDDEN, _expert(), num_experts=2, ep_size=2)
    with pytest.raises(ValueError, match="ep_size 2 needs 2 ranks"):  # one process: no world to split
        layer.set_deepspeed_parallelism()
    tp = MoE(HIDDEN, _expert(), num_experts=2, enable_expert_tensor_parallelism=True)
    with pytest.raises(ValueError, match="needs an mpu"):
        tp.set_deepspeed_parallelism()


def test_one_process_layer_with_used_token():
    from zero_ext.moe import MoE

    torch.manual_seed(2)
    layer = MoE(HIDDEN, _expert(), num_experts=4, k=1, min_capacity=0, drop_tokens=False)
    x = torch.randn(10, HIDDEN)
    used = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1, 1, 0])
    out, l_aux, counts = layer(x, used)
    assert out[used == 0].abs().sum() == 0 and out[used == 1].abs().sum() > 0
    assert int(counts.sum()) == 7


def test_compat_names_are_zero_ext_objects():
    import deepspeed.moe.experts as experts
    import deepspeed.moe.layer as layer
    import deepspeed.moe.sharded_moe as sharded
    import deepspeed.utils.groups as ds_groups
    import zero_ext.moe as moe
    from zero_ext import comm

    assert layer.MoE is moe.MoE and experts.Experts is moe.Experts and sharded.MOELayer is moe.MOELayer
    assert sharded.top1gating is moe.top1gating and sharded.dist is comm
    assert ds_groups._create_expert_and_data_parallel(1) == "ep_size_1"
    assert ds_groups._get_expert_parallel_world_size("ep_size_1") == 1
    ds_groups.mpu = "an mpu"
    try:
        assert moe.groups.get_mpu() == "an mpu"
    finally:
        ds_groups.mpu = None
