"""safe_get / safe_set (zero_ext.utils) against the single-process reference (torch.optim.AdamW), stages
0-3, with and without ZeRO-Offload. Without offload the config sets torch_adam, so the engine steps with
torch's AdamW too and N=1 is bit-exact. With offload_optimizer cpu the state lives in host memory and the
engine steps it with the C CPUAdam, which agrees with torch's AdamW within 1e-6 (|p| + lr) per step, so
offloaded runs are compared within the N-rank tolerance even at N=1; "nvme" keeps them in swap files."""
import tempfile

import pytest
import torch

from helpers.harness import RankFailed, restart_pool, run_ranks
from helpers.models import MLP

LR = 1e-2
# pairwise over stage x world x accumulation
CASES = [(0, 1, 1), (1, 2, 1), (2, 4, 1), (0, 2, 2), (1, 4, 2), (2, 1, 2), (2, 2, 2), (1, 1, 1), (0, 4, 1),
         (3, 1, 1), (3, 2, 2), (3, 4, 1)]
OFFLOAD_CASES = [(1, 2, 1, True), (2, 4, 2, True), (2, 1, 1, True), (3, 2, 2, True), (3, 1, 1, True),
                 (2, 2, 2, "nvme"), (3, 2, 1, "nvme")]


def _config(stage, gas, offload=False):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "torch_adam": not offload}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                  **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}}
    if offload == "nvme":  # ZeRO-Infinity: masters and Adam state in swap files under the temporary directory
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": tempfile.gettempdir()}
    elif offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def _batches(world, gas, steps):
    gen = torch.Generator().manual_seed(3)
    return [[[MLP.batch(2, gen) for _ in range(world)] for _ in range(gas)] for _ in range(steps)]


def _engine(stage, gas, offload=False):
    import zero_ext

    torch.manual_seed(0)
    return zero_ext.initialize(model=MLP(), config=_config(stage, gas, offload))[0]


def _reads(stage, world, gas, offload=False):
    """Two steps; at the last micro step of each: full and local grads; after each step: params, Adam."""
    from zero_ext import utils

    rank = torch.distributed.get_rank()
    engine = _engine(stage, gas, offload)
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    params = dict(engine.module.named_parameters())
    out = []
    for step in _batches(world, gas, 2):
        for micro in step:
            engine.backward(engine.module.loss(micro[rank]))
            if engine.is_gradient_accumulation_boundary():
                grads = {n: utils.safe_get_full_grad(params[n]) for n in names}
                local = {n: utils.safe_get_local_grad(params[n]) for n in names}
            engine.step()
        out.append({
            "grads": grads, "local_grads": local,
            "params": {n: utils.safe_get_full_fp32_param(params[n]) for n in names},
            "local_params": {n: utils.safe_get_local_fp32_param(params[n]) for n in names},
            "exp_avg": {n: utils.safe_get_full_optimizer_state(params[n], "exp_avg") for n in names},
            "local_exp_avg_sq": {n: utils.safe_get_local_optimizer_state(params[n], "exp_avg_sq") for n in names},
            "exp_avg_sq": {n: utils.safe_get_full_optimizer_state(params[n], "exp_avg_sq") for n in names},
        })
    out.append({"frozen": utils.safe_get_full_fp32_param(engine.module.frozen.weight)})
    engine.destroy()
    return out


def _reference(world, gas):
    torch.manual_seed(0)
    model = MLP()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in trainable], lr=LR, weight_decay=0.1, foreach=False)
    out = []
    for step in _batches(world, gas, 2):
        for micro in step:
            for r in range(world):
                loss = model.loss(micro[r])
                (loss / world / gas).backward() if (world, gas) != (1, 1) else loss.backward()
        grads = {n: p.grad.clone() for n, p in trainable}
        opt.step()
        opt.zero_grad()
        out.append({"grads": grads, "params": {n: p.detach().clone() for n, p in trainable},
                    "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in trainable},
                    "exp_avg_sq": {n: opt.state[p]["exp_avg_sq"].clone() for n, p in trainable}})
    return out


def _close(a, b, exact):
    if exact:
        return torch.equal(a, b)
    return bool(((a - b).abs() <= 1e-5 * (b.abs() + LR) + 1e-7).all())


@pytest.mark.parametrize("stage,world,gas,offload", [c + (False,) for c in CASES] + OFFLOAD_CASES)
def test_full_and_local_reads_match_the_reference(stage, world, gas, offload):
    results = run_ranks(world, _reads, stage, world, gas, offload)
    ref = _reference(world, gas)
    exact = world == 1 and not offload
    for rank_out in results:
        assert rank_out[-1]["frozen"] is None  # not owned by the engine: None, as in DeepSpeed
        for got, want in zip(rank_out[:-1], ref):
            for kind in ("grads", "params", "exp_avg", "exp_avg_sq"):
                for n, value in want[kind].items():
                    assert got[kind][n].shape == value.shape
                    assert _close(got[kind][n], value, exact), f"{kind} {n}"
    # local pieces, concatenated in rank order, are the full tensor (stage 0: each rank holds it all;
    # stage 3: the pieces are padded to ceil(numel / N), the padding zero)
    ranks = results if stage > 0 else results[:1]
    for step in range(2):
        for n, full in results[0][step]["params"].items():
            numel = full.numel()
            for kind, whole in (("local_params", full), ("local_grads", results[0][step]["grads"][n]),
                                ("local_exp_avg_sq", results[0][step]["exp_avg_sq"][n])):
                pieces = torch.cat([r[step][kind][n] for r in ranks])
                assert torch.equal(pieces[:numel], whole.reshape(-1)), (kind, n)
                assert not pieces[numel:].any()


def _full_shape(lp):
    from zero_ext.zero import is_zero_param

    return lp.ds_shape if is_zero_param(lp) else lp.shape  # the seed's idiom


def _whole(engine):
    """Every parameter's full value (stage 3: gathered for the read)."""
    import zero_ext

    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _seed_example_zero_params_and_state(stage, offload=False):
    """The seed's example: zero every fp32 parameter and Adam state after a step; the next step starts
    from zero moments (with weight decay on zero weights, the step is Adam's first step from 0)."""
    from zero_ext import utils

    rank = torch.distributed.get_rank()
    engine = _engine(stage, 1, offload)
    batches = _batches(torch.distributed.get_world_size(), 1, 2)
    engine.backward(engine.module.loss(batches[0][0][rank]))
    engine.step()
    for n, lp in engine.module.named_parameters():
        if not lp.requires_grad:
            continue
        zero = torch.zeros(_full_shape(lp))
        utils.safe_set_full_fp32_param(lp, zero)
        utils.safe_set_full_optimizer_state(lp, zero, "exp_avg")
        utils.safe_set_full_optimizer_state(lp, zero, "exp_avg_sq")
    seen_by_forward = _whole(engine)["head.weight"].abs().sum().item()
    x, y = batches[1][0][rank]
    engine.backward(engine.module.loss((x, y)))
    grads = {n: utils.safe_get_full_grad(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    engine.step()
    return seen_by_forward, grads, _whole(engine)


@pytest.mark.parametrize("stage,world,offload", [(1, 2, False), (2, 4, False), (0, 2, False), (3, 2, False),
                                                 (2, 2, True), (3, 2, True), (3, 2, "nvme")])
def test_seed_example_zeroing_params_and_adam_state(stage, world, offload):
    seen, grads, params = run_ranks(world, _seed_example_zero_params_and_state, stage, offload)[0]
    assert seen == 0.0  # the next forward sees the zeroed weights
    # Adam from zero moments at step 2: m = (1-b1) g, v = (1-b2) g^2, bias-corrected with t = 2
    b1, b2, eps = 0.9, 0.999, 1e-8
    for n, g in grads.items():
        m, v = (1 - b1) * g, (1 - b2) * g * g
        update = (m / (1 - b1 ** 2)) / ((v / (1 - b2 ** 2)).sqrt() + eps)
        assert torch.allclose(params[n], -LR * update, rtol=1e-5, atol=1e-7), n


def _seed_example_zero_grads(stage, gas, offload=False):
    from zero_ext import utils

    rank = torch.distributed.get_rank()
    engine = _engine(stage, gas, offload)
    batches = _batches(torch.distributed.get_world_size(), gas, 1)
    before = _whole(engine)
    for micro in batches[0]:
        engine.backward(engine.module.loss(micro[rank]))
        if engine.is_gradient_accumulation_boundary():
            for lp in engine.module.parameters():
                if lp.requires_grad:
                    utils.safe_set_full_grad(lp, torch.zeros(_full_shape(lp)))
        engine.step()
    return before, _whole(engine)


@pytest.mark.parametrize("stage,gas,offload", [(0, 1, False), (1, 2, False), (2, 2, False), (3, 2, False),
                                               (1, 1, True), (3, 2, True), (2, 2, "nvme")])
def test_seed_example_zeroing_gradients_before_step(stage, gas, offload):
    before, after = run_ranks(2, _seed_example_zero_grads, stage, gas, offload)[0]
    # zero gradients: Adam's update is 0/(0+eps) = 0, only decoupled weight decay moves the weights
    for n in before:
        assert torch.allclose(after[n], before[n] * (1 - LR * 0.1), rtol=0, atol=1e-7) or n.startswith("frozen")


def _set_then_get(stage, offload=False):
    from zero_ext import utils

    rank = torch.distributed.get_rank()
    engine = _engine(stage, 1, offload)
    p = engine.module.body.weight
    shape = _full_shape(p)
    batches = _batches(torch.distributed.get_world_size(), 1, 1)
    engine.backward(engine.module.loss(batches[0][0][rank]))
    g = torch.arange(shape.numel(), dtype=torch.float32).view(shape) / 100
    utils.safe_update_full_grad_vectorized([p, engine.module.head.weight], lambda old, param: old * 0 + 1
                                           if param is not p else g)
    got_g = utils.safe_get_full_grad(p)
    ones = utils.safe_get_full_grad(engine.module.head.weight)
    local = utils.safe_get_local_fp32_param(p)
    utils.safe_set_local_fp32_param(p, torch.full_like(local, 0.5))
    engine.step()
    new = torch.full(shape, 0.25)
    utils.safe_set_full_fp32_param(p, new)
    return torch.equal(got_g, g), bool((ones == 1).all()), torch.equal(utils.safe_get_full_fp32_param(p), new)


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True),
                                           (3, True), (1, "nvme"), (3, "nvme")])
def test_set_then_get(stage, offload):
    assert run_ranks(2, _set_then_get, stage, offload) == [(True, True, True)] * 2


def _grad_lifecycle(stage, gas, when):
    from zero_ext import utils

    rank = torch.distributed.get_rank()
    engine = _engine(stage, gas)
    batches = _batches(torch.distributed.get_world_size(), gas, 1)
    if when == "before backward":
        return utils.safe_get_full_grad(engine.module.head.weight)
    engine.backward(engine.module.loss(batches[0][0][rank]))
    if when == "mid accumulation":
        return utils.safe_get_local_grad(engine.module.head.weight)
    engine.step()
    return utils.safe_get_full_grad(engine.module.head.weight)


@pytest.mark.parametrize("stage,gas,when,message", [
    (2, 1, "before backward", "there are no gradients now"),
    (1, 1, "after step", "there are no gradients now"),
    (1, 2, "mid accumulation", "averaged across ranks only at the gradient-accumulation boundary"),
])
def test_gradients_outside_their_lifetime_are_errors(stage, gas, when, message):
    with pytest.raises(RankFailed, match=message):
        run_ranks(2, _grad_lifecycle, stage, gas, when)


def test_stage_2_gradients_mid_accumulation_are_the_sum_so_far():
    local = run_ranks(2, _grad_lifecycle, 2, 2, "mid accumulation")
    assert all(t.abs().sum() > 0 for t in local if t.numel())


def test_missing_optimizer_state_key_is_named():
    from zero_ext import utils

    engine = _engine(1, 1)
    with pytest.raises(KeyError, match="'exp_avg' is not in the optimizer state.*first step"):
        utils.safe_get_full_optimizer_state(engine.module.head.weight, "exp_avg")


def _full_read_on_rank0_only(mismatch: bool):
    from zero_ext import utils

    engine = _engine(2, 1)
    rank = torch.distributed.get_rank()
    params = [p for p in engine.module.parameters() if p.requires_grad]
    torch.distributed.barrier()  # fresh processes start seconds apart under load: the 2 s check starts here
    if mismatch:  # every rank calls, for different parameters
        return utils.safe_get_full_fp32_param(params[rank])
    if rank == 0:
        return utils.safe_get_full_fp32_param(params[0])
    return None


@pytest.mark.parametrize("mismatch,message", [(False, "(only 1 of 2 ranks|not every rank) called it"),
                                              (True, "every rank must pass the same arguments")])
def test_debug_mode_turns_a_one_rank_full_read_into_an_error(mismatch, message):
    env = {"ZERO_EXT_DEBUG": "1", "ZERO_EXT_COLLECTIVE_CHECK_TIMEOUT": "2"}
    restart_pool(2)  # fresh call counters: an earlier test's one-rank call would shift them (as it should)
    with pytest.raises(RankFailed, match=message):
        run_ranks(2, _full_read_on_rank0_only, mismatch, env=env, timeout=60)


def _precision_reads(stage, dtype, offload):
    """bf16/fp16: reads in fp32 (fp16 gradients unscaled), pieces that add up, and a set the next forward sees."""
    import torch.distributed as dist

    import zero_ext
    from zero_ext import utils

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(stage, 1, offload)
    cfg["bf16" if dtype == "bf16" else "fp16"] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    torch.manual_seed(0)
    engine = zero_ext.initialize(model=MLP(), config=cfg)[0]
    half = torch.bfloat16 if dtype == "bf16" else torch.float16
    x, y = MLP.batch(2, torch.Generator().manual_seed(rank), half)
    engine.backward(engine.module.loss((x, y)))
    p = engine.module.head.weight
    full_grad, local_grad = utils.safe_get_full_grad(p), utils.safe_get_local_grad(p)
    engine.step()
    full_param, local_param = utils.safe_get_full_fp32_param(p), utils.safe_get_local_fp32_param(p)
    value = torch.linspace(-1, 1, full_param.numel()).view_as(full_param) / 3
    utils.safe_set_full_fp32_param(p, value)
    with zero_ext.zero.GatheredParameters([p]):
        lp = p.detach().clone()
    pieces, grads = [None] * world, [None] * world  # (stages 1/2: fragments of different sizes per rank)
    dist.all_gather_object(pieces, local_param)
    dist.all_gather_object(grads, local_grad)
    engine.destroy()
    return (full_grad, torch.cat(grads)[:full_grad.numel()], full_param, torch.cat(pieces)[:full_param.numel()],
            lp, value, engine.optimizer.cur_scale if engine.optimizer else None, half)


def _fp32_grad(stage):
    from zero_ext import utils

    import zero_ext
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine = zero_ext.initialize(model=MLP(), config=_config(stage, 1))[0]
    x, y = MLP.batch(2, torch.Generator().manual_seed(rank), torch.float16)  # the same (rounded) inputs
    engine.backward(engine.module.loss((x.float(), y.float())))
    g = utils.safe_get_full_grad(engine.module.head.weight)
    engine.destroy()
    return g


@pytest.mark.parametrize("stage,dtype,offload", [(1, "bf16", False), (2, "fp16", False), (3, "bf16", False),
                                                 (3, "fp16", True), (2, "bf16", "nvme")])
def test_reads_and_writes_in_16_bit_training(stage, dtype, offload):
    results = run_ranks(2, _precision_reads, stage, dtype, offload)
    ref_grad = run_ranks(2, _fp32_grad, stage)[0]
    for full_grad, grad_pieces, full_param, pieces, lp, value, scale, half in results:
        assert full_grad.dtype == full_param.dtype == torch.float32
        assert torch.equal(grad_pieces.view_as(full_grad), full_grad)
        assert torch.equal(pieces.view_as(full_param), full_param)
        # unscaled (fp16's loss scale is 2^8 here) and close to the fp32 model's gradient
        tol = 2e-2 * ref_grad.abs().max().item()
        assert (full_grad - ref_grad).abs().max().item() <= tol
        assert lp.dtype == half and torch.equal(lp, value.to(half))  # the next forward sees the set value
