"""Mixture-of-experts models in the engine (optim/experts.py, checkpoint/experts.py): expert-parallel
training at ZeRO stages 0-2 must equal one plain PyTorch process that holds every expert and sees every
rank's batch.

The MoE layer routes each token to one expert (top-1, no token dropped), so the plain reference is
written out here: softmax gate, the chosen expert, its output times the gate value. On N ranks with
ep_size E, rank r holds experts ep_rank * (X / E) + i; their gradients are reduced over the ranks holding
the same experts and averaged over all N, the gradient norm (clipping on) counts each expert once.
"""
import os

import pytest
import torch

from helpers.harness import run_ranks

H, C, EXPERTS, BATCH, SEQ, LR, SGD_LR, CLIP, STEPS = 8, 3, 4, 2, 3, 1e-2, 0.5, 0.5, 3


def _model(ep_size: int):
    from zero_ext.moe.layer import MoE

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(H, H)
            expert = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.Tanh(), torch.nn.Linear(2 * H, H))
            self.moe = MoE(hidden_size=H, expert=expert, num_experts=EXPERTS, ep_size=ep_size, k=1,
                           drop_tokens=False, use_rts=False)
            self.out = torch.nn.Linear(H, C)

        def forward(self, x):
            h = self.inp(x)
            m, _, _ = self.moe(h)
            return self.out(m + h).reshape(-1, C)

    return Net()


def _reference():
    """The same network with every expert in one process, top-1 routing written out."""
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(H, H)
            self.wg = torch.nn.Linear(H, EXPERTS, bias=False)
            self.experts = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.Tanh(), torch.nn.Linear(2 * H, H))
                for _ in range(EXPERTS))
            self.out = torch.nn.Linear(H, C)

        def forward(self, x):
            h = self.inp(x)
            tokens = h.reshape(-1, H)
            probs = torch.softmax(self.wg(tokens), dim=1)
            chosen = probs.argmax(dim=1)
            m = torch.zeros_like(tokens)
            for e, expert in enumerate(self.experts):
                mask = (chosen == e).unsqueeze(1).to(tokens.dtype)
                m = m + mask * probs[:, e:e + 1] * expert(tokens)
            return self.out(m.reshape(h.shape) + h).reshape(-1, C)

    return Plain()


def _init_expert(expert: torch.nn.Module, global_id: int) -> None:
    """Each expert its own values (DeepSpeed's layer starts every expert as a copy of one)."""
    g = torch.Generator().manual_seed(100 + global_id)
    with torch.no_grad():
        for p in expert.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 + 17 * step + rank)
    return torch.randn(BATCH, SEQ, H, generator=g), torch.randint(0, C, (BATCH * SEQ,), generator=g)


def _local_experts(net):
    return net.moe.deepspeed_moe.experts.deepspeed_experts


def _dense(net):
    if hasattr(net, "wg"):  # the reference
        return [net.inp, net.out, net.wg]
    return [net.inp, net.out, net.moe.deepspeed_moe.gate.wg]


def _optimizer(params, client):
    """The client's optimizer is SGD, which sees any error in a gradient's scale (Adam would hide it)."""
    return torch.optim.SGD(params, lr=SGD_LR, momentum=0.9) if client else torch.optim.Adam(params, lr=LR)


def _train_reference(world: int, start, client):
    """``start``: the MoE model's dense modules before training (their values are the reference's)."""
    ref = _reference()
    for e, expert in enumerate(ref.experts):
        _init_expert(expert, e)
    for theirs, mine in zip(_dense(ref), start):
        theirs.load_state_dict(mine)
    opt = _optimizer(ref.parameters(), client)
    for step in range(STEPS):
        loss = sum(torch.nn.functional.cross_entropy(ref(x), y) for x, y in
                   (_batch(step, r) for r in range(world))) / world
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
    return ref


def _engine(stage: int, ep_size: int, client_optimizer, precision: str = "fp32", offload: bool = False):
    import torch.distributed as dist

    import zero_ext
    from zero_ext.moe.params import split_params_into_different_moe_groups_for_optimizer as split

    torch.manual_seed(0)
    net = _model(ep_size)
    ep_rank = dist.get_rank() % ep_size
    for i, expert in enumerate(_local_experts(net)):
        _init_expert(expert, ep_rank * (EXPERTS // ep_size) + i)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": CLIP, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 50}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if offload:  # ZeRO-Offload: the expert groups' masters and state in host memory, the C Adam steps them
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if client_optimizer:  # "split": its groups made by DeepSpeed's splitter; "plain": one group of everything
        params = list(net.parameters())
        optimizer = _optimizer(split({"params": params, "name": "all"}) if client_optimizer == "split" else params,
                               client=True)
        engine, *_ = zero_ext.initialize(model=net, optimizer=optimizer, config=cfg)
    else:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": LR}}
        engine, *_ = zero_ext.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    return engine, net


def _train_and_compare(stage: int, ep_size: int, client_optimizer, offload: bool = False):
    import torch.distributed as dist

    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param

    world, rank = dist.get_world_size(), dist.get_rank()
    engine, net = _engine(stage, ep_size, client_optimizer, offload=offload)
    with zero_ext.zero.GatheredParameters(list(net.parameters())):  # (stage 3: whole for the copy)
        start = [{k: v.clone() for k, v in m.state_dict().items()} for m in _dense(net)]
    assert engine.has_moe_layers and engine.num_experts == [EXPERTS]
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
    ref = _train_reference(world, start, client_optimizer)

    def value(p):  # (stage 3: the parameter is partitioned; its value is gathered)
        return safe_get_full_fp32_param(p) if stage == 3 else p.detach()

    worst = 0.0
    for mine, theirs in zip(_dense(net), _dense(ref)):
        for a, b in zip(mine.parameters(), theirs.parameters()):
            worst = max(worst, (value(a) - b.detach()).abs().max().item())
    local = EXPERTS // ep_size
    for i, expert in enumerate(_local_experts(net)):
        theirs = ref.experts[(rank % ep_size) * local + i]
        for a, b in zip(expert.parameters(), theirs.parameters()):
            worst = max(worst, (value(a) - b.detach()).abs().max().item())
            full = safe_get_full_fp32_param(a)  # (stages 1/2: gathered over the expert-data-parallel group)
            worst = max(worst, (full - b.detach()).abs().max().item())
    engine.destroy()
    return worst


# (world, ep_size, stage, client optimizer): each stage with E < N (expert-data-parallel groups of
# several ranks) and E = N (one rank per expert group), client and config optimizers
@pytest.mark.parametrize("world,ep_size,stage,client,offload", [
    (4, 2, 0, "split", False), (4, 2, 1, None, False), (4, 2, 2, "plain", False), (4, 4, 2, None, False),
    (4, 4, 0, "plain", False), (2, 2, 1, "split", False), (4, 2, 2, "split", False), (4, 4, 1, "split", False),
    (4, 2, 2, None, True), (2, 2, 1, None, True), (2, 1, 3, "split", False),  # ep_size 1: ordinary parameters
])
def test_expert_parallel_training_equals_one_plain_process(world, ep_size, stage, client, offload):
    worst = run_ranks(world, _train_and_compare, stage, ep_size, client, offload, timeout=120)
    assert max(worst) < 2e-6, worst  # fp32: the ranks' sums in another order than the reference's


def _refusals(case: str):
    import zero_ext

    net = _model(2)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if case == "stage3":  # (an AssertionError too, what DeepSpeed raises there)
        with pytest.raises(AssertionError, match="stage 3"):
            zero_ext.initialize(model=net, model_parameters=net.parameters(),
                                config={**config, "zero_optimization": {"stage": 3}})
    else:  # a model-parallel unit: expert groups would have to be laid out inside its data-parallel group
        with pytest.raises(NotImplementedError, match="mpu"):
            zero_ext.initialize(model=net, model_parameters=net.parameters(), mpu=_WholeWorld(), config=config)
    return True


class _WholeWorld:
    """An mpu whose data-parallel group is every rank (no model parallelism)."""

    def get_data_parallel_group(self):
        return None

    def get_data_parallel_rank(self):
        import torch.distributed as dist
        return dist.get_rank()

    def get_data_parallel_world_size(self):
        import torch.distributed as dist
        return dist.get_world_size()

    def get_model_parallel_group(self):
        return None

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1


@pytest.mark.parametrize("case", ["stage3", "mpu"])
def test_what_expert_parallelism_cannot_run_is_refused_with_the_fix(case):
    assert all(run_ranks(2, _refusals, case, timeout=60))


def _checkpoint_round_trip(stage: int, folder: str):
    import torch.distributed as dist

    rank = dist.get_rank()
    engine, net = _engine(stage, 2, client_optimizer=None)

    def step(k):
        x, y = _batch(k, rank)
        engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        engine.step()

    step(0)
    engine.save_checkpoint(folder, tag="t")
    step(1)
    after = [p.detach().clone() for p in net.parameters()]
    engine.destroy()
    torch.manual_seed(5)  # another start: everything must come from the checkpoint
    engine, net = _engine(stage, 2, client_optimizer=None)
    for p in net.parameters():
        with torch.no_grad():
            p.add_(1.0)
    engine.load_checkpoint(folder, tag="t")
    step(1)
    diff = max((a - p.detach()).abs().max().item() for a, p in zip(after, net.parameters()))
    files = sorted(f for f in os.listdir(os.path.join(folder, "t")) if f.startswith("layer_"))
    engine.destroy()
    return diff, files


@pytest.mark.parametrize("stage", [0, 2])
def test_a_checkpoint_keeps_every_expert_and_resumes_exactly(stage, tmp_path):
    out = run_ranks(4, _checkpoint_round_trip, stage, str(tmp_path), timeout=120)
    assert all(diff == 0.0 for diff, _ in out), out
    # one file per expert (DeepSpeed's names), written by the first rank of each expert's replicas
    assert out[0][1] == [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(EXPERTS)]


def _optimizer_state_bytes(stage: int, ep_size: int):
    import torch.distributed as dist

    from zero_ext._native import planner

    world = dist.get_world_size()
    engine, net = _engine(stage, ep_size, client_optimizer=None)  # Adam: two fp32 moments per element
    x, y = _batch(0, dist.get_rank())
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    engine.step()
    held = sum(engine.memory_breakdown()["optimizer_state"].values())
    expert_ids = {id(p) for p in _local_experts(net).parameters()}
    dense = [p.numel() for p in net.parameters() if id(p) not in expert_ids]
    experts = [p.numel() for p in _local_experts(net).parameters()]
    # the dense group cut over all ranks, the local experts' group over the world / ep_size holding them
    want = 8 * (planner.flat_layout(dense, world)[0] // world + planner.flat_layout(experts, world // ep_size)[0]
                // (world // ep_size))
    engine.destroy()
    return held, want


@pytest.mark.parametrize("stage", [1, 2])
def test_expert_optimizer_state_is_partitioned_over_the_ranks_holding_the_same_experts(stage):
    for held, want in run_ranks(4, _optimizer_state_bytes, stage, 2, timeout=120):
        assert held == want


def _export(folder: str):
    import torch.distributed as dist

    engine, net = _engine(2, 2, client_optimizer=None)
    x, y = _batch(0, dist.get_rank())
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    engine.step()
    mine = {i: [p.detach().clone() for p in e.parameters()] for i, e in enumerate(_local_experts(net))}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dist.get_rank() % 2, mine))
    engine.save_16bit_model(folder)
    engine.destroy()
    if dist.get_rank() != 0:
        return True
    whole = _model(1)  # the same network with every expert in one layer
    whole.load_state_dict(torch.load(os.path.join(folder, "pytorch_model.bin")), strict=True)
    local = EXPERTS // 2
    for ep_rank, experts in everyone:
        for i, params in experts.items():
            for a, b in zip(_local_experts(whole)[ep_rank * local + i].parameters(), params):
                assert torch.equal(a.detach(), b)
    return True


def test_the_16bit_export_holds_every_expert_under_its_global_name(tmp_path):
    assert all(run_ranks(4, _export, str(tmp_path), timeout=120))


def _expert_file_sizes(folder: str):
    import torch.distributed as dist

    engine, _ = _engine(1, 2, client_optimizer=None)
    engine.save_checkpoint(folder, tag="t")
    engine.destroy()
    if dist.get_rank() != 0:
        return True
    for name in sorted(os.listdir(os.path.join(folder, "t"))):
        if name.startswith("layer_"):
            experts = torch.load(os.path.join(folder, "t", name))
            held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in experts.values()}
            assert sum(held.values()) == sum(t.numel() * t.element_size() for t in experts.values()), name
    return True


def test_an_expert_file_holds_its_expert_alone(tmp_path):
    # (the parameters are views of one flat buffer: saved as they are, each file would hold all of it)
    assert all(run_ranks(4, _expert_file_sizes, str(tmp_path), timeout=120))
