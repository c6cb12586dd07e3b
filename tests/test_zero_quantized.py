"""ZeRO++ on ZeRO-3: qwZ (zero_optimization.zero_quantized_weights: the forward and backward gathers travel
as int8 with an fp32 scale per 2048 elements; every rank computes with the dequantized weights, the
optimizer steps the exact fp32 masters) and qgZ (zero_quantized_gradients: the gradient reduce-scatter
travels as int4 with a scale per 512 elements, 1-D parameters exact, summed in fp32 on arrival).

The reference is written from those semantics (helpers/quant_ref.py, torch operations only): a single
process whose forward and backward run on ``gathered_weight(W)`` (each rank's piece quantized on its own)
and whose gradient is ``reduced_gradient`` of the ranks' gradients (each piece quantized on its own),
while AdamW steps W. Against it the engine is held to the unquantized tolerances of ../shared/TESTING.md
(fp32 N>1: 1e-5 (|p| + lr), losses 1e-5 relative; bf16: the bf16 rules of test_engine_parity.py), since
the quantization itself is reproduced, not approximated. Against plain training the difference is the
formats' (docs/precision.md): how far the runs drift apart over 50 steps is bounded too.
"""
import math

import pytest
import torch

from helpers.engine import full_params, train
from helpers.harness import run_ranks
from helpers.models import MODELS
from helpers.quant_ref import gathered_weight, reduced_gradient

MICRO = 2
LR = 1e-2

QW = {"zero_quantized_weights": True}
QG = {"zero_quantized_gradients": True}
QN = {"zero_quantized_nontrainable_weights": True}
HPZ = {"zero_hpz_partition_size": 2}
OFFLOAD = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
# (dtype, world, gas, model, steps, zero options); qgZ cases at gas 1: the reference reproduces the
# engine's gradient bit for bit only where no 1/gas scaling precedes the quantization
CASES = [
    ("fp32", 2, 1, "gpt", 50, QW),
    ("fp32", 4, 3, "mlp", 6, {**QW, "stage3_prefetch_bucket_size": 100}),
    ("bf16", 2, 1, "gpt", 6, QW),
    ("fp32", 2, 1, "mlp", 6, {**QW, **OFFLOAD}),
    ("fp32", 2, 1, "gpt", 6, {**QG, "reduce_bucket_size": 200}),
    ("fp32", 4, 1, "mlp", 6, QG),
    ("bf16", 2, 1, "gpt", 6, QG),
    ("fp32", 4, 1, "gpt", 10, {**QW, **QG, **OFFLOAD}),
    ("fp32", 2, 1, "mlp", 6, QN),  # MLP's first layer is frozen
    ("bf16", 4, 1, "mlp", 6, {**QN, **QW}),
    # two levels (hpZ's nodes of 2): intra-node all-to-all, partial sums quantized again, inter-node
    ("fp32", 4, 1, "gpt", 6, {**QG, **HPZ, "reduce_bucket_size": 300}),
    ("bf16", 4, 1, "gpt", 6, {**QW, **QG, **HPZ}),
]


def _id(case):
    dtype, world, gas, model, steps, opts = case
    kinds = [k for k, on in (("qwZ", opts.get("zero_quantized_weights")), ("qgZ", opts.get("zero_quantized_gradients")),
                             ("frozen-int8", opts.get("zero_quantized_nontrainable_weights")),
                             ("offload", "offload_param" in opts), ("hpZ", "zero_hpz_partition_size" in opts)) if on]
    return f"{'+'.join(kinds)}-{dtype}-n{world}-gas{gas}-{model}-{steps}steps"


def _config(case, quantized=True):
    """The case's config; quantized=False: the same without ZeRO++."""
    dtype, world, gas, model, steps, opts = case
    if not quantized:
        opts = {k: v for k, v in opts.items() if k not in QW and k not in QG and k not in QN and k not in HPZ}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **opts}}


def _batches(case):
    dtype, world, gas, model, steps, opts = case
    gen = torch.Generator().manual_seed(99)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    return [[[MODELS[model].batch(MICRO, gen, dt) for _ in range(world)] for _ in range(gas)] for _ in range(steps)]


def _new_model(name):
    torch.manual_seed(0)
    return MODELS[name]()


def _train_engine(case, quantized=True):
    import zero_ext

    rank = torch.distributed.get_rank()
    model = _new_model(case[3])
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(),
                                          config=_config(case, quantized))
    losses = train(engine, _batches(case), rank)
    params = full_params(engine)  # GatheredParameters: exact values, not the quantized ones
    masters = {n: zero_ext.utils.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()
               if p.requires_grad}
    engine.destroy()
    return losses, params, masters


def _reference(case, quantized=True):
    """fp32 masters W stepped by the engine's AdamW; with qwZ forward and backward on gathered_weight(W)
    in the training dtype (bf16: the pieces are bf16 before quantization, and so are the dequantized
    weights); with qgZ the gradient is reduced_gradient of the ranks' own. quantized=False: plain."""
    from zero_ext.ops.adam import CPUAdam

    dtype, world, gas, model_name, steps, opts = case
    qw = quantized and opts.get("zero_quantized_weights", False)
    qg = quantized and opts.get("zero_quantized_gradients", False)
    qn = quantized and opts.get("zero_quantized_nontrainable_weights", False)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = _new_model(model_name).to(dt)
    named = dict(model.named_parameters())
    master = {n: p.detach().float().clone() for n, p in named.items()}
    trained = [n for n, p in named.items() if p.requires_grad]
    groups = []
    for g in model.param_groups():
        ids = {id(p) for p in g["params"]}
        groups.append({**g, "params": [master[n] for n in trained if id(named[n]) in ids]})
    opt = CPUAdam(groups, lr=LR, weight_decay=0.01)
    losses = [[] for _ in range(world)]
    for step in _batches(case):
        with torch.no_grad():
            for n, p in named.items():
                w = master[n].to(dt)
                if qn and not p.requires_grad:  # its piece is kept as int8 from the start
                    w = gathered_weight(w, world)
                p.copy_(gathered_weight(w, world) if qw else w)
        grads = {n: torch.zeros_like(master[n]) for n in trained}
        for micro in step:
            by_rank = []
            for r in range(world):
                model.zero_grad()
                loss = model.loss(micro[r])
                (loss / gas).backward()
                losses[r].append(loss.float().item())
                by_rank.append({n: named[n].grad.clone() if named[n].grad is not None else torch.zeros_like(named[n])
                                for n in trained})
            for n in trained:
                if qg:  # the engine adds each rank's share, fp32, then scales by 1 / world
                    total = reduced_gradient([g[n] for g in by_rank], world, quantized=named[n].dim() > 1,
                                             node=opts.get("zero_hpz_partition_size", 1))
                    grads[n].add_(total.view(grads[n].shape), alpha=1.0 / world)
                else:
                    for g in by_rank:
                        grads[n] += g[n].float() / world
        for n in trained:
            master[n].grad = grads[n]
        opt.step()
    return losses, master


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_zeropp_trains_as_the_reference(case):
    dtype, world, gas, model, steps, opts = case
    results = run_ranks(world, _train_engine, case, timeout=240)
    ref_losses, ref_master = _reference(case)
    for r, (losses, params, masters) in enumerate(results):
        assert params.keys() == results[0][1].keys()
        for n in params:  # every rank reads the same exact values
            assert torch.equal(params[n], results[0][1][n]), n
        got = torch.tensor(losses)
        want = torch.tensor(ref_losses[r])
        rtol = 1e-5 if dtype == "fp32" else 2e-2
        assert torch.allclose(got, want, rtol=rtol, atol=0), (r, (got - want).abs().max().item())
        for n, m in masters.items():
            if dtype == "fp32":
                assert ((m - ref_master[n]).abs() <= 1e-5 * (ref_master[n].abs() + LR)).all(), n
            else:  # test_engine_parity.py's bf16 rules
                assert ((m - ref_master[n]).abs() <= 2 ** -6 * ref_master[n].abs() + 2 * steps * LR).all(), n
        if dtype == "bf16":
            num = math.sqrt(sum((masters[n] - ref_master[n]).double().pow(2).sum().item() for n in masters))
            den = math.sqrt(sum(ref_master[n].double().pow(2).sum().item() for n in masters))
            assert num / den <= 2 ** -5
        if dtype == "fp32":  # GatheredParameters reads the exact masters (qwZ only touches training gathers)
            for n, m in masters.items():
                assert torch.equal(params[n], m), n


# (options, loss bound, weight bound): measured on 2 ranks, 50 steps at lr 1e-2 (TinyGPT): qwZ 0.6 % on
# losses and 1.3 % relative L2 on the weights; qwZ + qgZ 1.4 % and 5.5 % (int4 keeps 3 bits of magnitude)
DRIFT = [(QW, 1e-2, 3e-2), ({**QW, **QG}, 3e-2, 1e-1)]


@pytest.mark.parametrize("opts,loss_bound,weight_bound", DRIFT, ids=["qwZ", "qwZ+qgZ"])
def test_quantized_training_stays_near_plain_training(opts, loss_bound, weight_bound):
    """Over 50 steps the quantized run and plain training (both references, checked against the engine
    above) stay close: int8 weights are off by at most s/2 (about 0.4 % of their block's largest
    magnitude), int4 gradients by 7 %, and neither error accumulates, since the masters are exact; the
    gradients they perturb move Adam's normalised steps, so the masters part by a bounded amount."""
    case = ("fp32", 2, 1, "gpt", 50, opts)
    q_losses, q_master = _reference(case, quantized=True)
    p_losses, p_master = _reference(case, quantized=False)
    q, p = torch.tensor(q_losses[0]), torch.tensor(p_losses[0])
    assert ((q - p).abs() / p).max() < loss_bound, ((q - p).abs() / p).max()
    num = math.sqrt(sum((q_master[n] - p_master[n]).double().pow(2).sum().item() for n in q_master))
    den = math.sqrt(sum(p_master[n].double().pow(2).sum().item() for n in q_master))
    assert num / den < weight_bound, num / den
    assert not torch.equal(q, p)  # and the quantization is not a no-op


def _gathered_values(_):
    import zero_ext

    model = _new_model("mlp")
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(),
                                          config=_config(("fp32", 2, 1, "mlp", 1, QW)))
    seen = {}
    def look(module, args):  # runs after ZeRO-3's own pre-hook gathered the weight
        seen.setdefault("body", module.weight.detach().clone())

    hook = engine.module.body.register_forward_pre_hook(look)
    engine.module.loss(MODELS["mlp"].batch(MICRO, torch.Generator().manual_seed(1)))
    hook.remove()
    with zero_ext.zero.GatheredParameters([engine.module.body.weight]):
        exact = engine.module.body.weight.detach().clone()
    engine.destroy()
    return seen["body"], exact


def _frozen_bytes(quantized):
    import zero_ext

    model = _new_model("mlp")
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(),
                                          config=_config(("fp32", 2, 1, "mlp", 1, QN), quantized))
    params = engine.memory_breakdown()["params"]["accelerator"]
    with zero_ext.zero.GatheredParameters([engine.module.frozen.weight]):
        value = engine.module.frozen.weight.detach().clone()
    engine.destroy()
    return params, value


def test_frozen_pieces_kept_as_int8_count_their_bytes_and_read_dequantized():
    for (q_bytes, q_value), (p_bytes, p_value) in zip(run_ranks(2, _frozen_bytes, True),
                                                       run_ranks(2, _frozen_bytes, False)):
        # frozen.weight (13 x 7) and frozen.bias (13) in pieces of 46 and 7 fp32 elements, kept as int8 with
        # one scale each: 46 * 4 + 7 * 4 bytes become 46 + 4 + 7 + 4
        assert p_bytes - q_bytes == (46 * 4 + 7 * 4) - (46 + 4 + 7 + 4)
        assert torch.equal(q_value, gathered_weight(p_value, 2)) and not torch.equal(q_value, p_value)


def test_forward_sees_the_dequantized_weight_and_gathered_parameters_the_exact_one():
    for inside_forward, exact in run_ranks(2, _gathered_values, None):
        assert torch.equal(exact, _new_model("mlp").body.weight.detach())
        assert torch.equal(inside_forward, gathered_weight(exact, 2))
        assert not torch.equal(inside_forward, exact)


@pytest.mark.parametrize("key", ["zero_quantized_weights", "zero_quantized_gradients"])
def test_zeropp_below_stage_3_warns_that_it_does_nothing(key):
    from zero_ext.config import load_config

    with pytest.warns(Warning, match=key):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, key: True}})


def _all_to_all_bytes(zero):
    import zero_ext
    from zero_ext.comm import traffic

    rank = torch.distributed.get_rank()
    model = _new_model("gpt")
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(),
                                          config=_config(("fp32", 4, 1, "gpt", 1, zero)))
    loss = engine.module.loss(MODELS["gpt"].batch(MICRO, torch.Generator().manual_seed(rank)))
    traffic.start(node_size=2)
    engine.backward(loss)
    counted = traffic.snapshot()["by_verb"]["all_to_all"]
    traffic.stop()
    engine.destroy()
    return counted


def test_two_level_qgz_sends_half_the_cross_node_bytes_on_two_nodes_of_two():
    """World 4 as two nodes of two (hpZ's nodes): only the second all-to-all crosses, one record of partial
    sums per bucket instead of one per remote rank, so L = 2 times fewer cross-node bytes than one level
    (same buckets, fp32 either way); the first all-to-all stays inside the node."""
    flat = run_ranks(4, _all_to_all_bytes, QG)
    two = run_ranks(4, _all_to_all_bytes, {**QG, **HPZ, "stage3_max_reuse_distance": 0})
    for (flat_total, flat_cross), (two_total, two_cross) in zip(flat, two):
        assert flat_cross > 0 and two_cross * 2 == flat_cross
        assert two_total == flat_total  # (node: 1 share of 4 records; cross: 1 of 2 partial records)
