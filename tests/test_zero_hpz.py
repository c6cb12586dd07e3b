"""ZeRO++ hpZ (zero_optimization.zero_hpz_partition_size): after its forward each parameter keeps a secondary
piece inside its node (world 4 with size 2: two "nodes" of two ranks), and gathering it again within the
same step (the backward pass) is an all-gather over the node only. The copies hold the very bits the first
gather produced, so training is bit-identical to plain ZeRO-3 (and to qwZ alone with qwZ on), which the
parity tests hold against PyTorch; the secondary pieces are counted in memory_breakdown() by their formula
and gone after the step."""
import pytest
import torch

from helpers.engine import full_params, train
from helpers.harness import run_ranks
from helpers.models import MODELS

MICRO = 2


def _config(zero):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def _batches(world, steps=4):
    gen = torch.Generator().manual_seed(5)
    return [[[MODELS["gpt"].batch(MICRO, gen) for _ in range(world)]] for _ in range(steps)]


def _run(zero, memory=False):
    import zero_ext

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = MODELS["gpt"]()
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(), config=_config(zero))
    out = {"losses": train(engine, _batches(world), rank)}
    zm = engine.zero_model
    out["gathers"] = zm.secondary.gathers if zm.secondary is not None else 0
    if memory:  # one more forward and backward: the copies live from the forward's release to the step
        loss = engine.module.loss(_batches(world, 1)[0][0][rank])
        after_forward = engine.memory_breakdown()["hpz_secondary"]["accelerator"]
        engine.backward(loss)
        engine.step()
        out["memory"] = (after_forward, engine.memory_breakdown()["hpz_secondary"]["accelerator"],
                         sum(-(-p.ds_numel // 2) * p.element_size() for p in engine.module.parameters()))
    out["params"] = full_params(engine)
    engine.destroy()
    return out


def _pair(a, b):
    return _run(a, memory=True), _run(b, memory=True)


# no prefetch and no reuse: a model this small would otherwise stay gathered from forward to backward;
# then a small prefetch bucket, so that prefetched gathers and node-local ones mix
NO_PREFETCH = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
SMALL_PREFETCH = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 300}


@pytest.mark.parametrize("extra", [NO_PREFETCH, {**NO_PREFETCH, "zero_quantized_weights": True}, SMALL_PREFETCH],
                         ids=["hpZ", "hpZ+qwZ", "hpZ-prefetch"])
def test_hpz_trains_bit_for_bit_as_without_it_and_gathers_backward_within_the_node(extra):
    plain = dict(extra)
    for with_hpz, without in run_ranks(4, _pair, {"zero_hpz_partition_size": 2, **plain}, plain, timeout=240):
        assert with_hpz["losses"] == without["losses"]
        for n, p in with_hpz["params"].items():
            assert torch.equal(p, without["params"][n]), n
        assert with_hpz["gathers"] > 0 and without["gathers"] == 0
        after_forward, after_step, formula = with_hpz["memory"]
        if extra["stage3_prefetch_bucket_size"] == 0:  # every parameter released after the forward
            assert after_forward == formula  # ceil(numel / 2) elements each
        assert 0 < after_forward <= formula and after_step == 0
        assert without["memory"][:2] == (0, 0)


def _error(zero):
    import zero_ext

    model = MODELS["mlp"]()
    try:
        zero_ext.initialize(model=model, model_parameters=model.param_groups(), config=_config(zero))
    except Exception as exc:  # noqa: BLE001 - the type and message are what is checked
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("zero,message", [
    ({"zero_hpz_partition_size": 3}, "zero_hpz_partition_size = 3 does not divide the 4 ranks"),
    ({"zero_hpz_partition_size": 2, "offload_param": {"device": "cpu"}}, "with offload_param"),
])
def test_bad_hpz_settings_are_named_on_every_rank(zero, message):
    for kind, text in run_ranks(4, _error, zero):
        assert kind == "ConfigError" and message in text


def test_hpz_of_the_whole_world_is_plain_zero3():
    for out in run_ranks(2, _run, {"zero_hpz_partition_size": 2}):
        assert out["gathers"] == 0
