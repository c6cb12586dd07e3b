"""memory_breakdown() against the per-stage formulas of docs/memory.md, term by term, at named points.

Psi is the trainable element count of a param group padded to the planner's layout (a multiple of
2 * N), summed over groups; N the world size; B the stage 2 bucket buffer in elements.
"""
import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP

BUCKET = 100


def _expected(stage, dtype, world, psi, frozen_bytes, buffer_bytes, bucket_numel, overlap, point):
    lp = 2 if dtype == "bf16" else 4
    shard = psi // world if stage in (1, 2) else psi  # stage 3: psi is already this rank's pieces
    # stage 2 frees the fp32 gradient partition and the buckets after the step (the next backward makes them)
    freed = stage == 2 and point.startswith("after step")
    exp = {
        "params": lp * psi + frozen_bytes,  # stage 3: pieces, and the frozen parameters' pieces
        "grads": lp * psi if stage < 2 else 0,  # stages 2/3: freed as their buckets are reduced
        # fp32 masters and fp32 gradient partitions alias the model's own tensors in fp32 (stages 0/1)
        "fp32_master": 0 if dtype == "fp32" else 4 * shard,
        "fp32_grads": 0 if (dtype == "fp32" and stage < 2) or freed else 4 * shard,
        "optimizer_state": 8 * shard,  # Adam: exp_avg + exp_avg_sq in fp32
        # stage 3's buckets live only while they are reduced
        # (one rank reduces nothing: its gradients go straight into the fp32 partition, no bucket)
        "comm_buffers": lp * bucket_numel * (2 if overlap else 1) if stage == 2 and world > 1 and not freed else 0,
        "buffers": buffer_bytes,
    }
    return exp


def _measure(stage, dtype, overlap):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": dtype == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, "overlap_comm": overlap,
                                    **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}}
    engine, opt, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(), config=config)
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    points = {}
    for step in range(2):
        loss = engine.module.loss(MLP.batch(2, gen, dt))
        engine.backward(loss)
        points[f"after backward {step}"] = engine.memory_breakdown()
        engine.step()
        points[f"after step {step}"] = engine.memory_breakdown()
    opt = engine.zero_optimizer  # (the base itself at stage 0 over fp32)
    psi = sum(g.padded for g in opt.flat_groups)
    frozen = sum(getattr(p, "ds_tensor", p).numel() * p.element_size()
                 for p in engine.module.parameters() if not p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in engine.module.buffers())
    bucket_numel = getattr(opt.reducer, "buffer_numel", 0)
    engine.destroy()
    return points, psi, frozen, buffers, bucket_numel, _transport_share(engine.world_size)


def _transport_share(world):
    """docs/memory.md's formula for the native transport's segment, this rank's share."""
    from zero_ext.comm import native

    if native.for_group() is None:
        return 0
    slot = (64 << 10) if world == 1 else min(4 << 20, (32 << 20) // world)
    header = -(-(256 * (world + 1)) // 4096) * 4096
    share = (header + 2 * world * slot) // world
    assert native.buffer_bytes() == share
    return share


CASES = [(s, d, n, o) for s in (0, 1, 2) for d in ("fp32", "bf16") for n in (2,) for o in (False,)]
CASES += [(2, "bf16", 2, True), (2, "fp32", 1, False), (1, "bf16", 1, False)]
CASES += [(3, "fp32", 2, False), (3, "bf16", 2, True), (3, "bf16", 1, False), (3, "fp32", 4, True)]


@pytest.mark.parametrize("stage,dtype,world,overlap", CASES)
def test_breakdown_matches_the_formula(stage, dtype, world, overlap):
    for rank, (points, psi, frozen, buffers, bucket_numel, transport) in enumerate(
            run_ranks(world, _measure, stage, dtype, overlap, timeout=120)):
        assert psi % (2 * world) == 0 or stage == 3
        for point, table in points.items():
            if point == "after backward 0":
                continue  # Adam creates its state lazily, at the first step
            exp = _expected(stage, dtype, world, psi, frozen, buffers, bucket_numel, overlap, point)
            exp["comm_buffers"] += transport
            for kind, want in exp.items():
                got = table[kind]["accelerator"]
                assert got == want, f"rank {rank}, {point}: {kind} = {got} bytes, the formula says {want}"
                assert table[kind]["host"] == 0 and table[kind]["nvme"] == 0
            assert table["total"]["accelerator"] == sum(exp.values())


def test_stage_2_frees_gradients_and_shards_what_stage_0_replicates():
    (z0,) = [r[0]["after backward 1"] for r in run_ranks(2, _measure, 0, "bf16", False)][:1]
    (z2,) = [r[0]["after backward 1"] for r in run_ranks(2, _measure, 2, "bf16", False)][:1]
    assert z2["grads"]["accelerator"] == 0 < z0["grads"]["accelerator"]
    # half the Adam state per rank, up to the padding of each group to a multiple of 2N
    assert 0 <= 2 * z2["optimizer_state"]["accelerator"] - z0["optimizer_state"]["accelerator"] <= 8 * 4 * 2
    assert z2["total"]["accelerator"] < z0["total"]["accelerator"]


def _stage_2_through_accumulation(dtype):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "bf16": {"enabled": dtype == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET}}
    engine, opt, _, _ = zero_ext.initialize(model=model, model_parameters=model.param_groups(), config=config)
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    points = []
    for micro in range(4):
        engine.backward(engine.module.loss(MLP.batch(2, gen, dt)))
        engine.step()
        table = engine.memory_breakdown()
        points.append((table["fp32_grads"]["accelerator"],
                       table["comm_buffers"]["accelerator"] - _transport_share(engine.world_size)))
    opt = engine.zero_optimizer  # (the base itself at stage 0 over fp32)
    psi = sum(g.padded for g in opt.flat_groups)
    bucket_numel = opt.reducer.buffer_numel
    engine.destroy()
    return points, psi, bucket_numel


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stage_2_keeps_its_gradient_partition_while_accumulating_and_frees_it_after_the_step(dtype):
    lp = 2 if dtype == "bf16" else 4
    for points, psi, bucket_numel in run_ranks(2, _stage_2_through_accumulation, dtype):
        held = (4 * psi // 2, lp * bucket_numel)  # the fp32 partition 4 psi / N, one bucket buffer
        # micro steps 0 and 2 end inside the accumulation, 1 and 3 at its boundary (the step applied)
        assert points == [held, (0, 0), held, (0, 0)]
