"""MiCS (zero_optimization.mics_shard_size, mics_hierarchical_params_gather; zero/mics.py).

World 4 with mics_shard_size 2 is two shard groups of two ranks, each holding every parameter, gradient
and optimizer state cut two ways; the groups are replicas. Against plain PyTorch MiCS changes nothing
but the order of the gradient sum (inside the shard group, then across the replicas), so the parity
tests use test_engine_parity.py's reference and tolerances (fp32 N > 1: |dp| <= 1e-5 (|p| + lr); bf16
its stated bound), and test_engine_fp16.py's for fp16 (with an overflow on one rank only, which every
rank must skip). Rank r > 0 starts from other values: replicas are equal only through partitioning.
"""
import os

import pytest
import torch

from helpers.engine import full_params, optimizer_state, train
from helpers.harness import run_ranks
from helpers.models import MODELS
from test_engine_parity import _check_against_reference, _id, _train_engine

Z = {"stage3_param_persistence_threshold": 0}
CASES = [  # pairwise over dtype x world x shard size x the stage-3 options MiCS goes through
    (3, "fp32", 4, 1, "gpt", 1.0, {**Z, "mics_shard_size": 2}),
    (3, "bf16", 4, 3, "mlp", 1.0, {**Z, "mics_shard_size": 2, "overlap_comm": True, "reduce_bucket_size": 50}),
    (3, "fp32", 2, 3, "mlp", 0.05, {**Z, "mics_shard_size": 1, "sub_group_size": 100}),  # replicas only
    (3, "fp32", 4, 1, "mlp", 1.0, {**Z, "mics_shard_size": 2, "offload_param": {"device": "cpu"}}),
    (3, "bf16", 2, 1, "gpt", 1.0, {**Z, "mics_shard_size": 2, "offload_optimizer": {"device": "cpu"}}),
]


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_mics_matches_pytorch(case):
    _check_against_reference(case, run_ranks(case[2], _train_engine, case, timeout=240))


def _fp16_run(zero, *case):
    import test_engine_fp16 as fp16

    plain = fp16._config
    fp16._config = lambda *a: {**plain(*a), "zero_optimization": {**plain(*a)["zero_optimization"], **zero}}
    try:
        return fp16._engine_run(*case)
    finally:  # (the pooled worker runs other tests next)
        fp16._config = plain


def test_mics_fp16_matches_the_reference_and_skips_one_ranks_overflow_everywhere():
    import test_engine_fp16 as fp16

    case = (3, 4, 1, "gpt", False)
    results = run_ranks(4, _fp16_run, {"mics_shard_size": 2}, *case, timeout=240)
    ref_trajectory, ref_params = fp16._reference(*case)
    for r, out in enumerate(results):
        assert out["trajectory"] == ref_trajectory, f"rank {r}: skipped steps / loss scale differ"
    for n, ref in ref_params.items():
        excess = ((results[0]["params"][n] - ref).abs() - (2 ** -9 * ref.abs() + 2 * fp16.STEPS * fp16.LR)).max()
        assert excess.item() <= 0, n


# -- what each rank holds, and the two-level gather ---------------------------------------------------------

def _config(zero, dtype="bf16"):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, **Z, **zero}}


def _batches(world, steps):
    gen = torch.Generator().manual_seed(3)
    return [[[MODELS["gpt"].batch(2, gen) for _ in range(world)]] for _ in range(steps)]


def _memory(zero):
    import zero_ext

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = MODELS["gpt"]()
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(), config=_config(zero))
    train(engine, _batches(world, 1), rank)
    mem = {k: v["accelerator"] for k, v in engine.memory_breakdown().items()}
    numels = [p.ds_numel for p in engine.module.parameters()]
    engine.destroy()
    return mem, numels


def test_memory_breakdown_is_sized_by_the_shard_group_not_the_world():
    for zero, shard in (({"mics_shard_size": 2}, 2), ({}, 4)):
        for mem, numels in run_ranks(4, _memory, zero, timeout=240):
            piece = sum(-(-n // shard) for n in numels)  # ceil(numel / shard size) elements per parameter
            assert mem["params"] == 2 * piece  # bf16 pieces
            assert mem["fp32_master"] == 4 * piece and mem["fp32_grads"] == 4 * piece
            assert mem["optimizer_state"] == 2 * 4 * piece  # Adam's two moments (the step count is a scalar)


def _gather_run(zero, count_traffic):
    import zero_ext
    from zero_ext.comm import traffic

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = MODELS["gpt"]()
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(),
                                          config=_config(zero, "fp32"))
    if count_traffic:
        traffic.start(node_size=2)
    losses = train(engine, _batches(world, 3), rank)
    gathered = traffic.snapshot()["by_verb"].get("all_gather", [0, 0])
    traffic.stop()
    out = {"losses": losses, "params": full_params(engine), "all_gather": gathered}
    engine.destroy()
    return out


def test_hierarchical_gather_gives_the_same_bits_with_half_the_cross_node_bytes():
    flat = {"mics_shard_size": 4, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 300}
    env = {"NDEV_PER_NODE": "2"}  # two "nodes" of two ranks
    one = run_ranks(4, _gather_run, flat, True, env=env, timeout=240)
    two = run_ranks(4, _gather_run, {**flat, "mics_hierarchical_params_gather": True}, True, env=env, timeout=240)
    for a, b in zip(one, two):
        assert a["losses"] == b["losses"]
        for n, p in a["params"].items():
            assert torch.equal(p, b["params"][n]), n
        # flat: each piece to 3 ranks, 2 of them on the other node; two levels: to 1 rank on the other node
        # (the fetch-order agreements, also all-gathers, are counted too and unchanged: hence >=)
        total_flat, cross_flat = a["all_gather"]
        total_two, cross_two = b["all_gather"]
        assert cross_two < cross_flat and cross_flat - cross_two >= 0.45 * cross_flat - 4096
        assert total_two == pytest.approx(total_flat, rel=0.01)


# -- zero.MiCS_Init ---------------------------------------------------------------------------------------

def _mics_init():
    import zero_ext

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = _config({"mics_shard_size": 2}, "fp32")
    torch.manual_seed(rank)  # every rank builds other values: global rank 0's must win everywhere
    with zero_ext.zero.MiCS_Init(config_dict_or_path=cfg):
        model = MODELS["mlp"]()
    pieces = [p.ds_tensor.numel() for p in model.parameters()]
    groups = {torch.distributed.get_world_size(p.ds_process_group) for p in model.parameters()}
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(), config=cfg)
    values = full_params(engine)
    engine.destroy()
    torch.manual_seed(0)
    with zero_ext.zero.Init(config_dict_or_path=cfg):
        plain = MODELS["mlp"]()
    try:
        zero_ext.initialize(model=plain, model_parameters=plain.param_groups(), config=cfg)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return pieces, groups, values, [p.numel() for p in MODELS["mlp"]().parameters()], refused


def test_mics_init_partitions_in_shard_groups_with_rank_0s_values():
    results = run_ranks(4, _mics_init, timeout=240)
    torch.manual_seed(0)
    ref = dict(MODELS["mlp"]().named_parameters())
    for pieces, groups, values, numels, refused in results:
        assert pieces == [-(-n // 2) for n in numels] and groups == {2}
        for n, p in values.items():
            assert torch.equal(p, ref[n].detach()), n
        assert "zero.MiCS_Init" in refused


# -- checkpoints: MiCS -> plain ZeRO-3 -> MiCS ------------------------------------------------------------

def _round_trip(folder):
    import zero_ext

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def engine_for(zero):
        torch.manual_seed(0)
        model = MODELS["gpt"]()
        return zero_ext.initialize(model=model, model_parameters=model.param_groups(),
                                   config=_config(zero, "fp32"))[0]

    def state(engine):
        return full_params(engine), optimizer_state(engine, "exp_avg"), optimizer_state(engine, "exp_avg_sq")

    mics = engine_for({"mics_shard_size": 2})
    train(mics, _batches(world, 2), rank)
    mics.save_checkpoint(folder, tag="mics")
    saved_mics = state(mics)
    mics.destroy()
    plain = engine_for({})
    plain.load_checkpoint(folder, tag="mics")
    loaded_plain = state(plain)
    train(plain, _batches(world, 1), rank)
    plain.save_checkpoint(folder, tag="plain")
    saved_plain = state(plain)
    plain.destroy()
    again = engine_for({"mics_shard_size": 2})
    again.load_checkpoint(folder, tag="plain")
    loaded_again = state(again)
    again.load_checkpoint(folder, tag="mics")  # the same layout: each rank reads its shard rank's file alone
    reloaded_mics = state(again)
    again.destroy()
    files = sorted(f for f in os.listdir(os.path.join(folder, "mics")) if f.endswith("optim_states.pt"))
    return saved_mics, loaded_plain, saved_plain, loaded_again, reloaded_mics, files


def _same(a, b):
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_checkpoint_round_trip_mics_to_plain_zero3_and_back(tmp_path):
    for saved_mics, loaded_plain, saved_plain, loaded_again, reloaded_mics, files in run_ranks(
            4, _round_trip, str(tmp_path), timeout=240):
        assert _same(saved_mics, loaded_plain) and _same(saved_plain, loaded_again)
        assert _same(saved_mics, reloaded_mics)
        assert files == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]  # shard group 0's
    import json

    from zero_ext.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    manifest = json.load(open(tmp_path / "mics" / "zero_ext_manifest.json"))
    assert manifest["layout"]["world"] == 2 and manifest["layout"]["mics_shard_size"] == 2
    offline = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="mics")  # the converter reads it too
    assert all(torch.equal(offline[n], p) for n, p in saved_mics[0].items())


# -- bad combinations --------------------------------------------------------------------------------------

def _error(zero):
    import zero_ext

    model = MODELS["mlp"]()
    try:
        zero_ext.initialize(model=model, model_parameters=model.param_groups(), config=_config(zero, "fp32"))
    except Exception as exc:  # noqa: BLE001 - the type and message are what is checked
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("zero,message", [
    ({"mics_shard_size": 3}, "mics_shard_size = 3 does not divide the 4 ranks"),
    ({"mics_shard_size": 8}, "mics_shard_size = 8 is larger than the 4 ranks"),
    ({"mics_shard_size": 2, "offload_optimizer": {"device": "cpu"}}, "with offload_optimizer"),
    ({"mics_shard_size": 2, "mics_hierarchical_params_gather": True}, "lies inside one node of 2 ranks"),
])
def test_bad_mics_settings_are_named_on_every_rank(zero, message):
    for kind, text in run_ranks(4, _error, zero, env={"NDEV_PER_NODE": "2"}, timeout=240):
        assert kind == "ConfigError" and message in text


@pytest.mark.parametrize("zero,message", [
    ({"mics_shard_size": 2, "zero_hpz_partition_size": 2}, "MiCS and hpZ"),
    ({"mics_hierarchical_params_gather": True}, "has no effect without MiCS"),
    ({"mics_shard_size": 4, "mics_hierarchical_params_gather": True, "zero_quantized_weights": True},
     "zero_quantized_weights"),
])
def test_bad_mics_combinations_fail_at_load(zero, message):
    from zero_ext.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, **zero}})


# -- with qwZ and qgZ (inside the shard group) -------------------------------------------------------------

def test_mics_with_qwz_and_qgz_trains_as_the_quantized_reference(monkeypatch):
    """test_zero_quantized.py's reference with MiCS's cuts: weights quantized per piece of the shard group
    (s pieces), gradients quantized-reduced inside each shard group, the groups' fp32 sums then added."""
    import test_zero_quantized as tq
    from helpers.quant_ref import gathered_weight, reduced_gradient

    s = 2
    case = ("fp32", 4, 1, "gpt", 6, {**tq.QW, **tq.QG, "mics_shard_size": s})
    monkeypatch.setattr(tq, "gathered_weight", lambda w, world: gathered_weight(w, s))
    monkeypatch.setattr(tq, "reduced_gradient", lambda grads, world, quantized, node=1: sum(  # one level in MiCS
        reduced_gradient(grads[k:k + s], s, quantized=quantized) for k in range(0, len(grads), s)))
    results = run_ranks(4, tq._train_engine, case, timeout=240)
    ref_losses, ref_master = tq._reference(case)
    for r, (losses, params, masters) in enumerate(results):
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses[r]), rtol=1e-5, atol=0), r
        for n, m in masters.items():
            assert ((m - ref_master[n]).abs() <= 1e-5 * (ref_master[n].abs() + tq.LR)).all(), n


def _modify_on_rank_3():
    import zero_ext

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    cfg = _config({"mics_shard_size": 2}, "fp32")
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(), config=cfg)
    name, weight = next((n, p) for n, p in engine.module.named_parameters() if p.requires_grad)
    with zero_ext.zero.GatheredParameters(weight, modifier_rank=3):
        if rank == 3:
            weight.data.fill_(0.5)
    value = full_params(engine)[name]
    master = zero_ext.utils.safe_get_full_fp32_param(weight)
    engine.destroy()
    return value, master


def test_gathered_parameters_modifier_rank_is_a_global_rank_and_replicas_follow():
    for value, master in run_ranks(4, _modify_on_rank_3, timeout=240):  # (ranks 0 and 2 head the shard groups)
        assert torch.equal(value, torch.full_like(value, 0.5)) and torch.equal(master, value)


def test_deepspeeds_mics_init_paths_resolve_to_zero_ext():
    import subprocess
    import sys

    from helpers import ROOT

    compat = os.path.join(ROOT, "compat")
    code = ("from deepspeed.zero import MiCS_Init\n"
            "from deepspeed.runtime.zero import MiCS_Init as R\n"
            "from deepspeed.runtime.zero.mics import MiCS_Init as M\n"
            "import deepspeed, zero_ext\n"
            "assert MiCS_Init is R is M is zero_ext.zero.MiCS_Init and issubclass(M, zero_ext.zero.Init)\n"
            "print(deepspeed.__file__)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([compat, ROOT])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(compat)
