"""ZeRO-Infinity optimizer offload (offload_optimizer.device = "nvme") in the engine.

NVMe offload changes where the fp32 masters and optimizer state are kept between steps, not the
arithmetic: training must equal CPU offload bit for bit (losses, parameters, masters, Adam state),
stages 1-3, 1 and 2 ranks, fp32 and bf16, with each pipeline_read / pipeline_write / fast_init
setting. Swap files live in a per-run directory under nvme_path (a temporary directory on the local
disk here) and are gone after engine.destroy(). A checkpoint of an NVMe run loads into a CPU-offload
engine. The thread fallback (ZERO_EXT_AIO=threads) gives the same results; a full or missing drive
is refused at initialize.
"""
import os

import pytest
import torch

from helpers.engine import fp32_masters, full_params, optimizer_state
from helpers.harness import RankFailed, run_ranks
from helpers.models import MODELS
from helpers.fs import mount

LR = 1e-2
STEPS = 4

# (stage, dtype, world, model, offload_optimizer options) pairwise
CASES = [
    (1, "fp32", 1, "mlp", {"pipeline_read": True}),
    (2, "bf16", 2, "gpt", {"pipeline_write": True, "fast_init": True}),
    (3, "fp32", 2, "gpt", {"pipeline_read": True, "pipeline_write": True}),
    (3, "bf16", 1, "mlp", {"fast_init": True}),
    (2, "fp32", 1, "gpt", {}),
    (1, "bf16", 2, "mlp", {"pipeline_read": True, "pipeline_write": True, "fast_init": True}),
    # stages 1/2 with the partition in sub-groups (sub_group_size below it; see _config)
    (2, "bf16", 2, "gpt", {"pipeline_read": True, "pipeline_write": True, "sliced": True}),
    (1, "fp32", 1, "mlp", {"pipeline_write": True, "fast_init": True, "sliced": True}),
    (2, "fp32", 1, "mlp", {"sliced": True}),
    (1, "bf16", 2, "gpt", {"pipeline_read": True, "fast_init": True, "sliced": True}),
]


def _config(stage, dtype, offload):
    offload = dict(offload)
    sliced = offload.pop("sliced", False)
    zero = {"stage": stage, "offload_optimizer": offload}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, sub_group_size=80)
    elif sliced:  # a partition of several sub-groups, with a short last one
        zero.update(sub_group_size=70)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "zero_optimization": zero}


def _train(stage, dtype, model_name, offload, save_to=None):
    import zero_ext

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MODELS[model_name]()
    engine, _, _, _ = zero_ext.initialize(model=model, config=_config(stage, dtype, offload),
                                          model_parameters=model.parameters())
    gen = torch.Generator().manual_seed(7)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    losses = []
    for _ in range(STEPS):
        batches = [MODELS[model_name].batch(2, gen, dt) for _ in range(torch.distributed.get_world_size())]
        loss = engine.module.loss(batches[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    masters = fp32_masters(engine)
    states = optimizer_state(engine, "exp_avg_sq")
    params = full_params(engine)
    memory = engine.memory_breakdown()
    files = None
    if engine.optimizer.nvme is not None:
        swap_dir = engine.optimizer.nvme.swapper.dir.path
        files = sorted((f, oct(os.stat(os.path.join(swap_dir, f)).st_mode & 0o777),
                        os.path.getsize(os.path.join(swap_dir, f)))
                       for f in os.listdir(swap_dir) if not f.startswith("."))
    if save_to is not None:
        engine.save_checkpoint(save_to, tag="t")
    engine.destroy()
    left = os.path.exists(swap_dir) and os.listdir(swap_dir) if files is not None else None
    return losses, params, masters, states, memory, files, left


def _nvme_and_cpu(stage, dtype, model_name, options, nvme_path, ckpt):
    nvme = _train(stage, dtype, model_name, {"device": "nvme", "nvme_path": nvme_path, **options}, save_to=ckpt)
    cpu = _train(stage, dtype, model_name, {"device": "cpu"})
    loaded = _load_into_cpu_offload(stage, dtype, model_name, ckpt)
    return nvme, cpu, loaded


def _load_into_cpu_offload(stage, dtype, model_name, ckpt):
    import zero_ext

    torch.manual_seed(1)
    model = MODELS[model_name]()
    engine, _, _, _ = zero_ext.initialize(model=model, config=_config(stage, dtype, {"device": "cpu"}),
                                          model_parameters=model.parameters())
    engine.load_checkpoint(ckpt, tag="t")
    out = fp32_masters(engine), optimizer_state(engine, "exp_avg_sq")
    engine.destroy()
    return out


def _id(case):
    stage, dtype, world, model, opts = case
    return f"z{stage}-{dtype}-n{world}-{model}" + "".join(f"-{k}" for k in opts)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_nvme_offload_equals_cpu_offload_bit_for_bit(tmp_path, case):
    stage, dtype, world, model, options = case
    (tmp_path / "nvme").mkdir()
    results = run_ranks(world, _nvme_and_cpu, stage, dtype, model, options, str(tmp_path / "nvme"),
                        str(tmp_path / "ckpt"), timeout=240)
    for rank, (nvme, cpu, loaded) in enumerate(results):
        assert nvme[0] == cpu[0], f"rank {rank}: losses differ"
        for n in nvme[1]:
            assert torch.equal(nvme[1][n], cpu[1][n]), f"rank {rank}: parameter {n} differs"
        for n in nvme[2]:
            assert torch.equal(nvme[2][n], cpu[2][n]) and torch.equal(nvme[3][n], cpu[3][n]), n
            assert torch.equal(loaded[0][n], cpu[2][n]) and torch.equal(loaded[1][n], cpu[3][n]), \
                f"{n}: the NVMe run's checkpoint does not load into a CPU-offload engine"
        mem = nvme[4]
        assert mem["fp32_master"]["nvme"] > 0 and mem["optimizer_state"]["nvme"] == 2 * mem["fp32_master"]["nvme"]
        assert mem["fp32_master"]["host"] == mem["optimizer_state"]["host"] == 0, mem
        assert mem["fp32_master"]["accelerator"] == mem["optimizer_state"]["accelerator"] == 0, mem
        state = mem["fp32_master"]["nvme"] + mem["optimizer_state"]["nvme"]
        # the step's new parameters wait in a staging buffer of the partition until every rank wrote its
        # state (optim/nvme_step.py): one element of the model's dtype per master element
        elems = mem["fp32_master"]["nvme"] // 4 // 2  # masters on the drive: two copies (the spare slot)
        staging = elems * (2 if dtype == "bf16" else 4)
        if stage in (1, 2) and not options.get("sliced"):  # one group: one swap buffer, not buffer_count copies
            assert staging < mem["comm_buffers"]["host"] <= -(-state // 2 // 4096) * 4096 + staging, mem
        if options.get("sliced"):  # buffer_count (4) buffers, at most one per sub-group, each of one
            slices = -(-elems // 70)  # sub-group (70 x 3 fp32, in one page)
            assert slices > 1 and mem["comm_buffers"]["host"] == min(4, slices) * 4096 + staging, mem
        assert nvme[5] and all(mode == "0o600" for _, mode, _ in nvme[5]), nvme[5]
        # what memory_breakdown says is on the drive is what the swap files hold (both slots of each
        # sub-group: the spare file of the step transaction), up to each file's padding to a page
        on_disk = sum(size for _, _, size in nvme[5])
        assert state <= on_disk < state + 2 * 4096 * len(nvme[5]), (state, on_disk, nvme[5])
        assert not nvme[6], f"swap files left after destroy(): {nvme[6]}"


def test_thread_fallback_gives_the_same_results(tmp_path):
    (tmp_path / "nvme").mkdir()
    args = (2, "fp32", "mlp", {"pipeline_read": True, "pipeline_write": True}, str(tmp_path / "nvme"),
            str(tmp_path / "ckpt"))
    nvme, cpu, _ = run_ranks(1, _nvme_and_cpu, *args, env={"ZERO_EXT_AIO": "threads"})[0]
    assert nvme[0] == cpu[0]
    assert all(torch.equal(nvme[1][n], cpu[1][n]) for n in nvme[1])


def _initialize(nvme_path):
    import zero_ext

    torch.manual_seed(0)
    model = MODELS["gpt"]()
    cfg = _config(2, "fp32", {"device": "nvme", "nvme_path": nvme_path})
    zero_ext.initialize(model=model, config=cfg, model_parameters=model.parameters())


def test_a_missing_nvme_path_is_made_and_one_that_cannot_be_made_is_refused(tmp_path):
    run_ranks(1, _initialize, str(tmp_path / "absent" / "swap"))
    assert os.stat(tmp_path / "absent" / "swap").st_mode & 0o777 == 0o700
    (tmp_path / "file").write_text("x")
    with pytest.raises(RankFailed, match="does not exist and cannot be created"):
        run_ranks(1, _initialize, str(tmp_path / "file" / "swap"))


def test_a_drive_too_small_is_refused_at_initialize_with_the_bytes(tmp_path, mounts):
    target = mount(tmp_path, "tmpfs", "size=16k")
    mounts.append(target)
    with pytest.raises(RankFailed, match=r"bytes needed for swap files, \d+ bytes free"):
        run_ranks(1, _initialize, str(target))


def test_a_file_system_without_o_direct_gives_the_same_results(tmp_path, mounts):
    target = mount(tmp_path, "ramfs")  # ramfs refuses O_DIRECT: buffered I/O, one warning
    mounts.append(target)
    args = (3, "bf16", "mlp", {"pipeline_read": True, "pipeline_write": True}, str(target), str(tmp_path / "ckpt"))
    nvme, cpu, _ = run_ranks(2, _nvme_and_cpu, *args)[0]
    assert nvme[0] == cpu[0]
    assert all(torch.equal(nvme[1][n], cpu[1][n]) for n in nvme[1])
    assert nvme[4]["optimizer_state"]["nvme"] > 0


def _sliced_resume_and_set(nvme_path, ckpt):
    """Stage 2, the partition in sub-groups: 2 steps, save, load into a fresh sliced engine, 2 more
    steps; then a safe_set of a master, read back. Against CPU offload trained 4 steps straight."""
    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    rank = torch.distributed.get_rank()
    nvme = {"device": "nvme", "nvme_path": nvme_path, "pipeline_read": True, "pipeline_write": True,
            "sliced": True}

    def engine_for(offload):
        torch.manual_seed(0)
        model = MODELS["gpt"]()
        return zero_ext.initialize(model=model, config=_config(2, "bf16", offload),
                                   model_parameters=model.parameters())[0]

    def train(engine, gen, steps):
        for _ in range(steps):
            batches = [MODELS["gpt"].batch(2, gen, torch.bfloat16) for _ in range(torch.distributed.get_world_size())]
            engine.backward(engine.module.loss(batches[rank]))
            engine.step()

    def read(engine):
        return fp32_masters(engine), optimizer_state(engine, "exp_avg")

    gen = torch.Generator().manual_seed(7)
    first = engine_for(nvme)
    train(first, gen, 2)
    first.save_checkpoint(ckpt, tag="t")
    first.destroy()
    second = engine_for(nvme)
    second.load_checkpoint(ckpt, tag="t")
    train(second, gen, 2)
    resumed = read(second)
    name, p = next((n, p) for n, p in second.module.named_parameters() if p.requires_grad)
    value = torch.full(tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape), 0.25)
    safe_set_full_fp32_param(p, value)
    after_set = safe_get_full_fp32_param(p)
    second.destroy()

    gen = torch.Generator().manual_seed(7)
    cpu = engine_for({"device": "cpu"})
    train(cpu, gen, 4)
    straight = read(cpu)
    cpu.destroy()
    return resumed, straight, torch.equal(after_set, value)


def test_sliced_stage2_resumes_from_a_checkpoint_and_takes_a_set_exactly(tmp_path):
    (tmp_path / "nvme").mkdir()
    for resumed, straight, set_ok in run_ranks(2, _sliced_resume_and_set, str(tmp_path / "nvme"),
                                               str(tmp_path / "ckpt"), timeout=240):
        for part in (0, 1):
            for n in straight[part]:
                assert torch.equal(resumed[part][n], straight[part][n]), n
        assert set_ok
