"""safe_get_full_grad / safe_get_local_grad inside engine.no_sync() (stages 0/1) and
engine.coalesce_grad_reduction() (stages 0-3): this rank's own accumulated gradient, not averaged and
without a collective, unscaled, as DeepSpeed answers there; the step after the block still applies the
gradients averaged over the ranks."""
import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP

MICRO = 3  # backward passes inside the block


def _config(stage, precision):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
        if precision == "bf16-fp32acc":
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _dtype(precision):
    return {"fp32": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)


def _batches(rank, dtype):
    gen = torch.Generator().manual_seed(10 + rank)
    return [MLP.batch(2, gen, dtype) for _ in range(MICRO)]


def _reads(stage, precision, block):
    import zero_ext
    from zero_ext.utils import safe_get_full_grad, safe_get_local_grad

    torch.manual_seed(0)
    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(stage, precision))
    rank = torch.distributed.get_rank()
    weight = engine.module.body.weight
    with (engine.no_sync() if block == "no_sync" else engine.coalesce_grad_reduction()):
        for batch in _batches(rank, _dtype(precision)):
            engine.backward(engine.module.loss(batch))
        full, local = safe_get_full_grad(weight), safe_get_local_grad(weight)
    engine.step()
    with zero_ext.zero.GatheredParameters([weight]):
        after = weight.detach().float().clone()
    return full, local, after


def _reference(world, precision):
    """Each rank's own gradient sum (in the model's dtype, as autograd accumulates it) and the weight
    after one SGD step on the rank average."""
    dtype = _dtype(precision)
    own = []
    for rank in range(world):
        torch.manual_seed(0)
        model = MLP().to(dtype)
        for batch in _batches(rank, dtype):
            model.loss(batch).backward()
        own.append(model.body.weight.grad.float())
    torch.manual_seed(0)
    start = MLP().to(dtype).body.weight.detach().float()
    return own, start - 0.1 * sum(own) / world


CASES = [(0, "fp32", "no_sync"), (1, "fp32", "no_sync"), (0, "fp16", "no_sync"), (1, "bf16", "no_sync"),
         (1, "bf16-fp32acc", "no_sync"), (1, "fp32", "coalesce"), (2, "fp32", "coalesce"), (2, "fp16", "coalesce"),
         (3, "bf16", "coalesce")]


@pytest.mark.parametrize("stage,precision,block", CASES, ids=[f"z{s}-{p}-{b}" for s, p, b in CASES])
def test_gradient_reads_inside_no_sync_are_this_ranks_own(stage, precision, block):
    tol = {"fp32": 1e-6, "fp16": 2e-3, "bf16": 2e-2, "bf16-fp32acc": 2e-2}[precision]
    own, stepped = _reference(2, precision)
    results = run_ranks(2, _reads, stage, precision, block)
    for rank, (full, local, after) in enumerate(results):
        assert full.dtype == torch.float32 and full.shape == own[rank].shape
        assert (full - own[rank]).abs().max().item() <= tol, f"rank {rank}: not its own gradient"
        # the ranks' own gradients differ (different batches): a rank average would fail this
        assert (full - own[1 - rank]).abs().max().item() > 10 * tol
        fragment = local.reshape(-1)
        # stage 0: the local form is the whole parameter; stages 1-3: this rank's slice of it
        assert fragment.numel() <= full.numel()
        flat = full.reshape(-1)
        assert any(torch.equal(fragment, flat[a:a + fragment.numel()])
                   for a in range(flat.numel() - fragment.numel() + 1))
        assert (after - stepped).abs().max().item() <= 10 * tol  # the step averaged the block's gradients
