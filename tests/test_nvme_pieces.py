"""ZeRO-Infinity parameter offload (offload_param.device = "nvme", stage 3).

The 16-bit pieces live in swap files and are read when gathered, written by the step, by
GatheredParameters(modifier_rank=...) and by checkpoint loads: training must equal offload_param "cpu"
bit for bit (1 and 2 ranks, fp32 and bf16, with the optimizer offloaded to CPU or NVMe, frozen
parameters' pieces on NVMe too), also when the model is built under zero.Init(remote_device="nvme").
"""
import os

import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MODELS

STEPS = 3


def _config(dtype, param_device, optimizer_device, nvme_path, max_in_cpu=0):
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 80,
            "offload_param": {"device": param_device},
            "offload_optimizer": {"device": optimizer_device}}
    if param_device == "nvme":
        zero["offload_param"].update(nvme_path=nvme_path, buffer_count=3, max_in_cpu=max_in_cpu)
    if optimizer_device == "nvme":
        zero["offload_optimizer"].update(nvme_path=nvme_path, pipeline_read=True)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "zero_optimization": zero}


def _train(model_name, dtype, param_device, optimizer_device, nvme_path, use_init=False, save_to=None,
           max_in_cpu=0):
    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = _config(dtype, param_device, optimizer_device, nvme_path, max_in_cpu)
    torch.manual_seed(0)
    with zero_ext.zero.Init(config_dict_or_path=cfg, enabled=use_init):
        model = MODELS[model_name]()
    engine, _, _, _ = zero_ext.initialize(model=model, config=cfg, model_parameters=model.parameters())
    files = None
    if engine.nvme_pieces is not None:
        d = engine.nvme_pieces.store.swapper.dir.path
        files = len([f for f in os.listdir(d) if not f.startswith(".")])
    gen = torch.Generator().manual_seed(3)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    losses = []
    for step in range(STEPS):
        batches = [MODELS[model_name].batch(2, gen, dt) for _ in range(world)]
        loss = engine.module.loss(batches[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        if step == 0:  # a modification through GatheredParameters reaches the piece and the master
            p = next(q for q in engine.module.parameters() if q.requires_grad)
            with zero_ext.zero.GatheredParameters([p], modifier_rank=0):
                if rank == 0:
                    p.data.mul_(0.5)
    masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    memory = engine.memory_breakdown()
    # a state routine's write reaches the piece on NVMe: the next gather sees it
    from zero_ext.utils import safe_set_full_fp32_param

    p = [q for q in engine.module.parameters() if q.requires_grad][-1]
    value = torch.full(tuple(p.ds_shape), 0.25)
    safe_set_full_fp32_param(p, value)
    with zero_ext.zero.GatheredParameters([p]):
        set_seen = torch.equal(p.detach().float(), value)
    safe_set_full_fp32_param(p, masters[[n for n, q in engine.module.named_parameters() if q is p][0]])
    assert set_seen, "safe_set_full_fp32_param did not reach the piece"
    if save_to:
        engine.save_checkpoint(save_to, tag="t")
    engine.destroy()  # the pieces come home from NVMe: the model keeps its weights
    with zero_ext.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return losses, params, masters, memory, files


def _load(model_name, dtype, ckpt):
    import zero_ext
    from zero_ext.utils import safe_get_full_fp32_param

    cfg = _config(dtype, "cpu", "cpu", None)
    torch.manual_seed(5)
    model = MODELS[model_name]()
    engine, _, _, _ = zero_ext.initialize(model=model, config=cfg, model_parameters=model.parameters())
    engine.load_checkpoint(ckpt, tag="t")
    masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    with zero_ext.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return masters, params


def _both(model_name, dtype, optimizer_device, use_init, max_in_cpu, nvme_path, ckpt):
    nvme = _train(model_name, dtype, "nvme", optimizer_device, nvme_path, use_init, save_to=ckpt, max_in_cpu=max_in_cpu)
    cpu = _train(model_name, dtype, "cpu", "cpu", None, use_init)
    return nvme, cpu, _load(model_name, dtype, ckpt)


# max_in_cpu: 0 keeps no piece in host memory between uses; 10**9 (DeepSpeed's default) caches them all
CASES = [("mlp", "fp32", 1, "cpu", False, 0), ("gpt", "bf16", 2, "cpu", True, 10**9),
         ("mlp", "bf16", 2, "nvme", False, 300), ("gpt", "fp32", 2, "nvme", True, 0)]


@pytest.mark.parametrize("model,dtype,world,optimizer_device,use_init,max_in_cpu", CASES)
def test_parameter_offload_to_nvme_equals_cpu_bit_for_bit(tmp_path, model, dtype, world, optimizer_device, use_init,
                                                          max_in_cpu):
    (tmp_path / "nvme").mkdir()
    results = run_ranks(world, _both, model, dtype, optimizer_device, use_init, max_in_cpu, str(tmp_path / "nvme"),
                        str(tmp_path / "ckpt"), timeout=240)
    for nvme, cpu, loaded in results:
        assert nvme[0] == cpu[0], "losses differ"
        for n in cpu[1]:
            assert torch.equal(nvme[1][n], cpu[1][n]), f"parameter {n} differs"
            assert torch.equal(loaded[1][n], cpu[1][n]), f"{n}: the checkpoint's weights differ"
        for n in cpu[2]:
            assert torch.equal(nvme[2][n], cpu[2][n]) and torch.equal(loaded[0][n], cpu[2][n]), n
        mem = nvme[3]
        assert mem["params"]["nvme"] > 0 and nvme[4] > 0, mem
        cached = mem["params"]["host"]  # pieces kept in host memory between uses: max_in_cpu's cache
        assert cached <= max_in_cpu * (2 if dtype == "bf16" else 4), mem
        assert (cached > 0) == (max_in_cpu > 0), mem


def _forward_only(nvme_path):
    import zero_ext

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0,
        "offload_param": {"device": "nvme", "nvme_path": nvme_path}}}
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    ref = MODELS["mlp"]()
    ref.load_state_dict(model.state_dict())
    engine, _, _, _ = zero_ext.initialize(model=model, config=cfg)
    x = MODELS["mlp"].batch(2, torch.Generator().manual_seed(1))[0]
    with torch.no_grad():
        out = engine(x)
    pieces_on_nvme = engine.memory_breakdown()["params"]["nvme"] > 0
    engine.destroy()
    return torch.equal(out, ref(x)), pieces_on_nvme


def test_a_forward_only_engine_keeps_every_piece_on_nvme(tmp_path):
    for same, on_nvme in run_ranks(2, _forward_only, str(tmp_path)):
        assert same and on_nvme


def _without_optimizer_offload(nvme_path):
    import zero_ext
    from zero_ext.config import ConfigError

    cfg = _config("fp32", "nvme", "none", nvme_path)
    del cfg["zero_optimization"]["offload_optimizer"]
    try:
        zero_ext.initialize(model=MODELS["mlp"](), config=cfg)
    except ConfigError as exc:
        return str(exc)


def test_parameter_offload_to_nvme_needs_the_optimizer_offloaded(tmp_path):
    assert "offload_optimizer.device" in run_ranks(1, _without_optimizer_offload, str(tmp_path))[0]


def _built_under_init(nvme_path):
    import zero_ext
    from zero_ext.zero import zero_param_of

    cfg = _config("bf16", "nvme", "cpu", nvme_path)
    torch.manual_seed(0)
    with zero_ext.zero.Init(config_dict_or_path=cfg):
        model = MODELS["mlp"]()
    zps = [zero_param_of(p) for p in model.parameters()]
    # every piece went to its swap file as its module was built: nothing of it is left in host memory
    on_nvme = all(zp.piece_io is not None and zp.shard.numel() == 0 for zp in zps)
    engine, _, _, _ = zero_ext.initialize(model=model, config=cfg)
    frozen_kept = all(zero_param_of(p).piece_io is not None for p in model.parameters() if not p.requires_grad)
    x, y = MODELS["mlp"].batch(2, torch.Generator().manual_seed(1), torch.bfloat16)
    engine.backward(engine.module.loss((x, y)))
    engine.step()
    engine.destroy()
    return on_nvme, frozen_kept


def test_zero_init_with_remote_device_nvme_writes_each_piece_as_it_is_made(tmp_path):
    for on_nvme, frozen_kept in run_ranks(2, _built_under_init, str(tmp_path)):
        assert on_nvme and frozen_kept


def test_zero_init_remote_device_nvme_without_a_path_is_refused():
    assert "offload_param.nvme_path" in run_ranks(1, _module_level_refused)[0]


def _module_level_refused():
    import zero_ext

    try:
        zero_ext.zero.Init(remote_device="nvme")
    except ValueError as exc:
        return str(exc)
