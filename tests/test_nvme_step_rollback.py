"""The NVMe drive fills up in the middle of an optimizer step (offload_optimizer.device = "nvme", stages
1, 2 and 3, 2 ranks; at stage 3 also with offload_param.device = "nvme"): every rank raises the same
NVMeStepError within seconds, nothing of the step is applied (the model, the masters, the optimizer
state in memory and in the swap files, the gradients), and once space
is freed step() takes the step that failed: training goes on bit for bit as a run that never failed
([Note: NVMe step transaction], zero_ext/optim/nvme_step.py); or zero_grad() drops it: bit for bit as a
run that dropped that batch.

The fault: on rank 0 only, the spare file the step writes for the second sub-group loses its reservation
(helpers/fs.lose_reservation: a sparse file on a full tmpfs), so the first sub-group's new state is
written and the second's write gets the kernel's ENOSPC; rank 1 writes everything."""
import errno
import os
import time

import pytest
import torch

from helpers.engine import fp32_masters, full_params, optimizer_state
from helpers.fs import lose_reservation, mount
from helpers.harness import run_ranks
from helpers.models import TinyGPT

STEPS = 4
FAIL_AT = 2  # the step whose write fails (1-based)


def _config(stage, dtype, swap, pipeline_write):
    zero = {"stage": stage, "sub_group_size": 1000,
            "offload_optimizer": {"device": "nvme", "nvme_path": swap, "pipeline_read": True,
                                  "pipeline_write": pipeline_write}}
    if stage == "3+params":  # the 16-bit pieces on NVMe too, one of them cached in host memory
        stage = zero["stage"] = 3
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap, "max_in_cpu": 600}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, sub_group_size=600)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "zero_optimization": zero}


def _local_state(engine):
    """Everything of this rank the step may change, read without collectives: the model's parameters
    (stage 3: its pieces), each group's 16-bit buffer, master, optimizer state and gradient, and the
    bytes of the swap files holding the committed state."""
    opt = engine.optimizer
    out = {"params": [p.detach().clone() for p in engine.module.parameters()],
           "grads": [g.grad.detach().clone() for g in opt.flat_groups]}
    with opt.materialized(modified=False):  # (with offload_param nvme the pieces are in memory only here)
        out["flat"] = [g.flat.detach().clone() for g in opt.flat_groups]
        out["masters"] = [g.master.detach().clone() for g in opt.flat_groups]
        out["states"] = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.optimizer.state[g.master].items()}
                         for g in opt.flat_groups]
    out["files"] = {}
    for store in [opt.nvme] + ([opt.nvme_pieces.store] if opt.nvme_pieces is not None else []):
        for key in store.keys():
            group = store._groups[key]
            path = store.swapper.dir.file(group.names[group.valid])
            with open(path, "rb") as f:
                out["files"][str(key)] = (os.path.basename(path), f.read())
    return out


def _cached(engine):
    """offload_param nvme: the pieces kept in host memory (max_in_cpu), by group."""
    pieces = engine.optimizer.nvme_pieces
    return {} if pieces is None else {k: t.clone() for k, t in pieces._cache.items()}


def _same(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, where


def _run(stage, dtype, pipeline_write, then, swap, full):
    import zero_ext
    from zero_ext.optim.nvme_step import NVMeStepError

    rank = torch.distributed.get_rank()
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    engine = zero_ext.initialize(model=TinyGPT().to(dt), config=_config(stage, dtype, swap, pipeline_write))[0]
    gen = torch.Generator().manual_seed(7 + rank)
    losses, fault = [], None
    for step in range(1, STEPS + 1):
        loss = engine.module.loss(TinyGPT.batch(2, gen))
        engine.backward(loss)
        losses.append(loss.float().item())
        if step == FAIL_AT and full is None and then == "drop":  # the run to compare with drops the batch
            engine.zero_grad()
            continue
        if step == FAIL_AT and full is not None:
            store = engine.optimizer.nvme
            engine.optimizer.ensure_reduced()  # (what step() does first: stage 1 reduces its gradients there)
            before, cached = _local_state(engine), _cached(engine)
            if rank == 0:  # the second sub-group in the step's order: the first is written already
                victim = store._groups[store.keys()[1]]
                lose_reservation(store.swapper._files[victim.spare], full)
            start = time.monotonic()
            try:
                engine.step()
                fault = "no error"
            except NVMeStepError as exc:
                fault = (type(exc).__name__, exc.errno, exc.rolled_back, exc.failed, str(exc))
            assert time.monotonic() - start < 10, "the error comes at once, on every rank"
            _same(before, _local_state(engine), f"rank {rank}: after the failed step")  # nothing changed
            kept = _cached(engine)  # the cache may have dropped what the step wrote, never kept a new value
            assert kept.keys() <= cached.keys() and all(torch.equal(t, cached[k]) for k, t in kept.items())
            assert engine.global_steps == FAIL_AT - 1 and engine.was_step_applied() is False
            if rank == 0:
                os.unlink(os.path.join(full, "filler"))  # space freed: the step is taken again, or dropped
            if then == "drop":
                engine.zero_grad()
                continue
        engine.step()
    result = (losses, fault, full_params(engine), fp32_masters(engine), optimizer_state(engine, "exp_avg"),
              optimizer_state(engine, "exp_avg_sq"), engine.global_steps)
    engine.destroy()
    return result


@pytest.mark.parametrize("stage,dtype,pipeline_write,then", [(1, "bf16", False, "retry"), (2, "fp32", True, "retry"),
                                                             (3, "fp32", True, "retry"), (2, "bf16", False, "drop"),
                                                             ("3+params", "bf16", False, "retry")])
def test_a_full_drive_mid_step_is_undone_on_every_rank_and_the_step_taken_again(stage, dtype, pipeline_write, then,
                                                                                tmp_path, mounts):
    full = mount(tmp_path, "tmpfs", "size=64k")
    mounts.append(full)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    args = (stage, dtype, pipeline_write, then)
    faulty = run_ranks(2, _run, *args, str(tmp_path / "a"), str(full), timeout=120)
    clean = run_ranks(2, _run, *args, str(tmp_path / "b"), None, timeout=120)
    errors = [r[1] for r in faulty]
    assert errors[0] == errors[1], errors  # the same error on every rank
    name, err, rolled_back, failed, message = errors[0]
    assert name == "NVMeStepError" and err == errno.ENOSPC and rolled_back and failed == {0: errno.ENOSPC}, errors
    assert "rank 0: ENOSPC (No space left on device)" in message and "call engine.step() again" in message
    for rank, (f, c) in enumerate(zip(faulty, clean)):
        assert c[1] is None and f[6] == c[6] == STEPS - (then == "drop")
        _same(f[0], c[0], f"rank {rank}: losses")
        _same(f[2:6], c[2:6], f"rank {rank}: parameters, masters, exp_avg, exp_avg_sq after {STEPS} steps")
