"""Checkpoints: exact resume, resharding, atomic saves, checked loads, zero_to_fp32, 16-bit export."""
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.engine import full_params
from helpers.harness import RankFailed, restart_pool, run_ranks
from helpers.models import MODELS

LR = 1e-2


def _config(stage, dtype, gas=1, micro=2, offload=False):
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": LR}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 64,
                                  **({"stage3_param_persistence_threshold": 16} if stage == 3 else {})}}
    if offload:  # ZeRO-Offload: masters and state in host memory, the C CPUAdam
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return cfg


def _dtype(dtype):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)


def _engine(stage, dtype, model_name="mlp", gas=1, micro=2, offload=False):
    import zero_ext

    torch.manual_seed(0)
    model = MODELS[model_name]()
    groups = model.param_groups()
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=groups,
                                          config=_config(stage, dtype, gas, micro, offload))
    return engine


def _train(engine, steps, model_name, dtype):
    """Batches drawn from the global RNG, per rank: exact resume needs the RNG state restored."""
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,)).item()))
        loss = engine.module.loss(MODELS[model_name].batch(2, gen, _dtype(dtype)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _snapshot(engine):
    opt = engine.zero_optimizer
    return {"params": full_params(engine),
            "masters": [g.master.detach().clone() for g in opt.flat_groups],
            "state": [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.optimizer.state.values()],
            "lr": engine.get_lr(), "steps": (engine.global_steps, engine.micro_steps), "scale": opt.cur_scale}


def _save_then_continue(tmp, stage, dtype, model_name, gas, offload=False):
    torch.manual_seed(100 + torch.distributed.get_rank())
    engine = _engine(stage, dtype, model_name, gas, offload=offload)
    _train(engine, 3, model_name, dtype)
    engine.save_checkpoint(tmp, client_state={"epoch": 7})
    losses = _train(engine, 3, model_name, dtype)
    return losses, _snapshot(engine)


def _load_then_continue(tmp, stage, dtype, model_name, gas, offload=False):
    torch.manual_seed(999)  # must not matter: the checkpoint restores every rank's RNG
    engine = _engine(stage, dtype, model_name, gas, offload=offload)
    path, client = engine.load_checkpoint(tmp)
    assert client == {"epoch": 7} and path.endswith("global_step3")
    losses = _train(engine, 3, model_name, dtype)
    return losses, _snapshot(engine)


def _same(a, b):
    assert a["steps"] == b["steps"] and a["lr"] == b["lr"] and a["scale"] == b["scale"]
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
    for s, t in zip(a["state"], b["state"]):
        assert s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s)


# pairwise over stage x precision x model x accumulation
RESUME = [(0, "fp32", "mlp", 1), (1, "bf16", "gpt", 2), (2, "fp32", "gpt", 2), (2, "bf16", "mlp", 1),
          (1, "fp32", "mlp", 1), (0, "bf16", "gpt", 2), (2, "fp16", "mlp", 1), (3, "fp32", "mlp", 2),
          (3, "bf16", "gpt", 1)]
# with ZeRO-Offload (stage 3: parameters offloaded too)
RESUME_OFFLOAD = [(1, "bf16", "gpt", 1), (2, "fp32", "mlp", 2), (3, "bf16", "mlp", 1), (2, "fp16", "gpt", 1),
                  (3, "fp32", "gpt", 2)]


@pytest.mark.parametrize("stage,dtype,model_name,gas,offload", [c + (False,) for c in RESUME] +
                         [c + (True,) for c in RESUME_OFFLOAD])
def test_exact_resume_in_fresh_processes(tmp_path, stage, dtype, model_name, gas, offload):
    before = run_ranks(2, _save_then_continue, str(tmp_path), stage, dtype, model_name, gas, offload)
    restart_pool(2)
    after = run_ranks(2, _load_then_continue, str(tmp_path), stage, dtype, model_name, gas, offload)
    for (l1, s1), (l2, s2) in zip(before, after):
        assert l1 == l2
        _same(s1, s2)


def _full_state(engine):
    """name -> (fp32 master, exp_avg, exp_avg_sq), whole, through the state routines (any stage)."""
    from zero_ext import utils

    out = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            out[n] = (utils.safe_get_full_fp32_param(p), utils.safe_get_full_optimizer_state(p, "exp_avg"),
                      utils.safe_get_full_optimizer_state(p, "exp_avg_sq"))
    steps = {int(s["step"]) for s in engine.zero_optimizer.optimizer.state.values()}
    return out, steps


GLOBAL_BATCH = 8


def _train_global(engine, first_step, steps):
    """The same global batch whatever the world size: rank r takes chunk r of it."""
    rank, world = torch.distributed.get_rank(), engine.world_size
    for step in range(first_step, first_step + steps):
        idx, target = MODELS["gpt"].batch(GLOBAL_BATCH, torch.Generator().manual_seed(step))
        chunk = GLOBAL_BATCH // world
        loss = engine.module.loss((idx[rank * chunk:(rank + 1) * chunk], target[rank * chunk:(rank + 1) * chunk]))
        engine.backward(loss)
        engine.step()


def _save_for_reshard(tmp, stage, offload=False):
    engine = _engine(stage, "fp32", "gpt", micro=GLOBAL_BATCH // torch.distributed.get_world_size(), offload=offload)
    _train_global(engine, 0, 3)
    engine.save_checkpoint(tmp)
    state = _full_state(engine)
    _train_global(engine, 3, 2)
    return state, full_params(engine)


def _load_resharded(tmp, stage, offload=False):
    engine = _engine(stage, "fp32", "gpt", micro=GLOBAL_BATCH // torch.distributed.get_world_size(), offload=offload)
    engine.load_checkpoint(tmp)
    state = _full_state(engine)
    _train_global(engine, 3, 2)
    return state, full_params(engine)


@pytest.mark.parametrize("saved,loaded", [((4, 2), (2, 2)), ((4, 2), (1, 1)), ((2, 1), (4, 2)), ((2, 2), (2, 0)),
                                          ((4, 3), (2, 3)), ((2, 3), (1, 2)), ((2, 2), (4, 3)),
                                          # saved with ZeRO-Offload, loaded without, and the other way
                                          ((4, 2, True), (2, 3)), ((2, 3), (1, 1, True))])
def test_resharding_keeps_parameters_and_optimizer_state(tmp_path, saved, loaded):
    (w_save, s_save, *o_save), (w_load, s_load, *o_load) = saved, loaded
    ref_state, ref_params = run_ranks(w_save, _save_for_reshard, str(tmp_path), s_save, bool(o_save))[0]
    results = run_ranks(w_load, _load_resharded, str(tmp_path), s_load, bool(o_load))
    for (state, steps), params in results:
        ref_values, ref_steps = ref_state
        assert steps == ref_steps and state.keys() == ref_values.keys()
        for n, values in state.items():  # bit for bit after resharding
            assert all(torch.equal(a, b) for a, b in zip(values, ref_values[n])), n
        # training on goes on from the same state (reduction order differs with N: fp32 tolerance)
        for n, p in params.items():
            assert ((p - ref_params[n]).abs() <= 1e-5 * (ref_params[n].abs() + LR)).all(), n


def _save_two_tags_dying_in_the_second(tmp):
    import zero_ext.checkpoint.engine_state as ck

    engine = _engine(2, "fp32")
    _train(engine, 1, "mlp", "fp32")
    engine.save_checkpoint(tmp, tag="A")
    saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    _train(engine, 1, "mlp", "fp32")
    real = ck.write_torch_file

    def dying(obj, path, **kwargs):
        if torch.distributed.get_rank() == 1:
            with open(path, "wb") as f:
                f.write(b"half a shard")
            os._exit(9)  # killed mid-save
        return real(obj, path, **kwargs)

    ck.write_torch_file = dying
    engine.save_checkpoint(tmp, tag="B")
    return saved


def _load_latest(tmp):
    engine = _engine(2, "fp32")
    path, _ = engine.load_checkpoint(tmp)
    return path, {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(RankFailed, match="rank 1 died"):
        run_ranks(2, _save_two_tags_dying_in_the_second, str(tmp_path), timeout=60)
    assert (tmp_path / "latest").read_text() == "A"
    (path, params), _ = run_ranks(2, _load_latest, str(tmp_path))
    assert path.endswith("A")
    assert params["head.weight"].abs().sum() > 0


def _save_mlp(tmp, stage=2):
    engine = _engine(stage, "fp32")
    _train(engine, 2, "mlp", "fp32")
    engine.save_checkpoint(tmp, tag="t")
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _load_tag(tmp, model_name="mlp"):
    engine = _engine(2, "fp32", model_name)
    return engine.load_checkpoint(tmp, tag="t")[0]


@pytest.mark.parametrize("damage,message", [
    ("truncate", "is truncated or overwritten"),
    ("flip", "is corrupted: its crc32c does not match"),
    ("remove", "is missing .*every rank's file must be present"),
])
def test_damaged_shards_are_named(tmp_path, damage, message):
    run_ranks(2, _save_mlp, str(tmp_path))
    shard = tmp_path / "t" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        shard.unlink()
    with pytest.raises(RankFailed, match=f"zero_pp_rank_1_mp_rank_00_optim_states.pt {message}"):
        run_ranks(2, _load_tag, str(tmp_path))


def test_a_different_model_is_refused(tmp_path):
    run_ranks(2, _save_mlp, str(tmp_path))
    with pytest.raises(RankFailed, match="does not match this one"):
        run_ranks(2, _load_tag, str(tmp_path), "gpt")


def _save_on_rank0_only(tmp):
    engine = _engine(1, "fp32")
    if torch.distributed.get_rank() == 0:
        engine.save_checkpoint(tmp)
    return True


def test_saving_on_rank_0_only_raises_instead_of_hanging(tmp_path):
    # the store's check names the count; the native agreement, when rank 1 has already left, names rank 1
    with pytest.raises(RankFailed, match=r"save_checkpoint is collective, but (only 1 of 2 ranks|not every rank) "
                                         r"called it"):
        run_ranks(2, _save_on_rank0_only, str(tmp_path), env={"ZERO_EXT_COLLECTIVE_CHECK_TIMEOUT": "3"},
                  timeout=60)


def _load_nothing(tmp):
    import warnings

    engine = _engine(1, "fp32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.load_checkpoint(tmp)
    return out, [str(w.message) for w in caught]


def test_no_latest_returns_none_none_with_a_warning(tmp_path):
    (out, caught), = run_ranks(1, _load_nothing, str(tmp_path))
    assert out == (None, None) and any("no 'latest' file" in m for m in caught)


def _save_and_export(tmp):
    engine = _engine(2, "bf16", "gpt")
    _train(engine, 2, "gpt", "bf16")
    engine.save_checkpoint(os.path.join(tmp, "ckpt"))
    engine.save_16bit_model(os.path.join(tmp, "export"))
    import torch.distributed as dist

    masters = {}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for g in engine.zero_optimizer.flat_groups:
        parts = [torch.empty_like(g.master) for _ in range(engine.world_size)]
        dist.all_gather(parts, g.master.detach())
        full = torch.cat(parts)
        for p, off, n in zip(g.params, g.offsets, g.numels):
            masters[names[id(p)]] = full[off:off + n].view(p.shape).clone()
    return masters, {k: v.clone() for k, v in engine.module.state_dict().items()}


def test_zero_to_fp32_rebuilds_the_masters_and_16bit_export(tmp_path):
    masters, lp = run_ranks(2, _save_and_export, str(tmp_path))[0]
    from zero_ext.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    for name, value in masters.items():
        assert torch.equal(sd[name], value), name
    assert sd["out.weight"] is sd["tok.weight"]  # tied weights share one tensor
    assert "mask" in sd  # buffers too
    exported = torch.load(tmp_path / "export" / "pytorch_model.bin", weights_only=True)
    assert exported.keys() == lp.keys() and all(torch.equal(exported[k], lp[k]) for k in lp)
    assert exported["tok.weight"].dtype == torch.bfloat16

    # the standalone copy next to the checkpoint runs with nothing but torch; sharded output
    out = tmp_path / "fp32"
    script = tmp_path / "ckpt" / "zero_to_fp32.py"
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), str(out), "--max_shard_size", "4KB"],
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    shards = {}
    for f in set(index["weight_map"].values()):
        shards.update(torch.load(out / f, weights_only=True))
    assert shards.keys() == sd.keys() and all(torch.equal(shards[k], sd[k]) for k in sd)


def _frozen_from_module(tmp):
    engine = _engine(1, "fp32")
    _train(engine, 1, "mlp", "fp32")
    engine.save_checkpoint(tmp)
    return engine.module.frozen.weight.detach().clone()


def test_zero_to_fp32_takes_frozen_parameters_from_the_module(tmp_path):
    frozen = run_ranks(2, _frozen_from_module, str(tmp_path))[0]
    out = subprocess.run([sys.executable, "-m", "zero_ext.checkpoint.zero_to_fp32", str(tmp_path), str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    sd = torch.load(tmp_path / "o" / "pytorch_model.bin", weights_only=True)
    assert torch.equal(sd["frozen.weight"], frozen)


def _save_stage3(tmp):
    from zero_ext import utils

    engine = _engine(3, "bf16")
    _train(engine, 2, "mlp", "bf16")
    engine.save_checkpoint(tmp)
    masters = {n: utils.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    frozen = full_params(engine)["frozen.weight"]
    return masters, frozen


def test_zero_to_fp32_rebuilds_a_stage_3_checkpoint(tmp_path):
    masters, frozen = run_ranks(2, _save_stage3, str(tmp_path))[0]
    from zero_ext.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    for name, value in masters.items():
        assert torch.equal(sd[name], value), name
    assert torch.equal(sd["frozen.weight"], frozen)  # from every rank's pieces
    assert "offset" in sd
