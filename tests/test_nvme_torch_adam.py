"""``torch_adam: true`` with offload_optimizer.device "nvme": torch.optim.AdamW's own update runs on the
masters and state the NVMe store streams in (ops/torch_stepped.py), at stages 1-3, with stage 1/2
partitions swapped in sub_group_size slices. Reference: torch.optim.AdamW on one process.

fp32, 1 rank: bit-exact (the same torch update on the same values; gradients are not clipped). 2 ranks:
|dp| <= 1e-5 (|p| + lr) (the reduction sums in another order)."""
import pytest
import torch

from helpers.engine import full_params, optimizer_state
from helpers.harness import run_ranks
from helpers.models import MLP

LR, STEPS = 1e-2, 4


def _config(stage, path, sub_group_size, amsgrad=False):
    zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": path},
            "sub_group_size": sub_group_size}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True,
                                                      "amsgrad": amsgrad}},
            "zero_optimization": zero}


def _batches(world):
    gen = torch.Generator().manual_seed(3)
    return [[MLP.batch(2, gen) for _ in range(world)] for _ in range(STEPS)]


def _engine_run(stage, path, sub_group_size, amsgrad=False):
    import zero_ext

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    engine, opt, *_ = zero_ext.initialize(model=MLP(), config=_config(stage, path, sub_group_size, amsgrad))
    kind = type(opt.optimizer).__name__
    for step in _batches(world):
        engine.backward(engine.module.loss(step[rank]))
        engine.step()
    out = full_params(engine), optimizer_state(engine, "exp_avg_sq"), kind
    engine.destroy()
    return out


def _reference(world, amsgrad=False):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01,
                            amsgrad=amsgrad)
    for step in _batches(world):
        (sum(model.loss(b) for b in step) / world).backward()
        opt.step()
        opt.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {names[id(p)]: s["exp_avg_sq"] for p, s in opt.state.items()})


@pytest.mark.parametrize("stage, sub_group_size, amsgrad", [(1, 1_000_000_000, False), (2, 60, False),
                                                            (3, 100, False), (2, 60, True)])
def test_one_rank_is_bit_exact_with_torch_adamw(tmp_path, stage, sub_group_size, amsgrad):
    params, states, kind = run_ranks(1, _engine_run, stage, str(tmp_path), sub_group_size, amsgrad)[0]
    want_params, want_states = _reference(1, amsgrad)
    assert kind == "TorchStepped"
    assert all(torch.equal(params[n], want_params[n]) for n in want_params)
    assert all(torch.equal(states[n].view_as(want_states[n]), want_states[n]) for n in want_states)


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_match_torch_adamw(tmp_path, stage):
    params, _, _ = run_ranks(2, _engine_run, stage, str(tmp_path), 50)[0]
    want, _ = _reference(2)
    assert all(((params[n] - want[n]).abs() <= 1e-5 * (want[n].abs() + LR)).all() for n in want)
