"""GPU checks (marked `gpu`; skipped without CUDA; run by benchmarks/gpu_suite.sh on a GPU machine).

Unverified until a GPU machine runs them: this development machine has none.
"""
import ctypes

import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP

pytestmark = pytest.mark.gpu


def test_cast_kernel_matches_torch_bit_for_bit():
    from zero_ext._native import cuda as _cuda
    from zero_ext._native.dtypes import zx_dtype

    lib = _cuda.library()
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-45, 3.4e38, float("inf"), float("-inf"), float("nan"),
                            1.0 + 2 ** -8, 1.0 + 3 * 2 ** -9, 65504.0, 65520.0, 6e-8])
    src = torch.cat([special, torch.randn(100_003) * 10]).cuda()
    stream = torch.cuda.current_stream().cuda_stream
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(src.shape, dtype=dtype, device="cuda")
        _cuda.check(lib.zx_cuda_cast(src.data_ptr(), zx_dtype(src.dtype), out.data_ptr(), zx_dtype(dtype),
                                     src.numel(), stream), "cast")
        torch.cuda.synchronize()
        want = src.to(dtype)
        same = (out.view(torch.int16) == want.view(torch.int16)) | (out.isnan() & want.isnan())
        assert bool(same.all()), f"{dtype}: {int((~same).sum())} elements differ"


def test_nccl_single_rank_communicator_all_reduce():
    from zero_ext._native import cuda as _cuda
    from zero_ext._native.dtypes import zx_dtype

    lib = _cuda.library()
    uid = ctypes.create_string_buffer(_cuda.NCCL_ID_BYTES)
    _cuda.check(lib.zx_nccl_unique_id(uid), "unique id")
    comm = ctypes.c_void_p()
    _cuda.check(lib.zx_nccl_comm_init(ctypes.byref(comm), 1, 0, uid), "comm init")
    x = torch.arange(10, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    stream = torch.cuda.current_stream().cuda_stream
    _cuda.check(lib.zx_nccl_all_reduce(comm, x.data_ptr(), y.data_ptr(), 10, zx_dtype(x.dtype), 0, stream), "ar")
    torch.cuda.synchronize()
    assert torch.equal(x, y)
    _cuda.check(lib.zx_nccl_comm_destroy(comm), "destroy")


def _train_on_gpu(stage, dtype):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "bf16": {"enabled": dtype == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 50}}
    engine, _, _, _ = zero_ext.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    for _ in range(5):
        x, y = (t.cuda() for t in MLP.batch(4, gen, dt))
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
    table = engine.memory_breakdown()
    allocated = torch.cuda.memory_allocated()
    return {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}, table, allocated


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_engine_on_one_gpu_matches_the_cpu_reference(stage):
    # init=False: initialize picks the CUDA backend (cpu:gloo,cuda:nccl) itself
    params, table, allocated = run_ranks(1, _train_on_gpu, stage, "fp32", timeout=300, init=False)[0]
    torch.manual_seed(0)
    ref = MLP()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = MLP.batch(4, gen)
        (ref(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for n, p in ref.named_parameters():  # GPU kernels round differently from CPU ones
        assert (params[n] - p.detach()).abs().max().item() <= 1e-4 * (p.abs().max().item() + 1e-2)
    assert table["total"]["accelerator"] > 0 and table["total"]["host"] == 0
    assert table["total"]["accelerator"] <= allocated


def _offload_on_gpu(stage, dtype, ratio):
    """ZeRO-Offload on a GPU: masters and Adam state in (pinned) host memory, the C step, the bf16 upload."""
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": ratio}}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, sub_group_size=60)
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": dtype == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}, "zero_optimization": zero}
    engine, _, _, _ = zero_ext.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    for _ in range(5):
        x, y = (t.cuda() for t in MLP.batch(4, gen, dt))
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()
    torch.cuda.synchronize()
    table = engine.memory_breakdown()
    allocated = torch.cuda.memory_allocated()
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    masters = [g.master for g in engine.optimizer.flat_groups]
    pinned = all(m.is_pinned() for m, g in zip(masters, engine.optimizer.flat_groups) if g.offloaded)
    return params, table, allocated, pinned


@pytest.mark.parametrize("stage,dtype,ratio", [(2, "fp32", 1.0), (2, "bf16", 1.0), (3, "bf16", 1.0),
                                               (3, "fp32", 0.5)])
def test_offload_on_one_gpu_matches_the_cpu_reference_and_keeps_state_off_the_gpu(stage, dtype, ratio):
    params, table, allocated, pinned = run_ranks(1, _offload_on_gpu, stage, dtype, ratio, timeout=300,
                                                 init=False)[0]
    torch.manual_seed(0)
    ref = MLP()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = MLP.batch(4, gen, torch.bfloat16 if dtype == "bf16" else torch.float32)
        (ref(x.float()) - y.float()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    tol = 1e-4 if dtype == "fp32" else 3e-2  # GPU kernels round differently; bf16 weights (2^-8)
    for n, p in ref.named_parameters():
        assert (params[n] - p.detach()).abs().max().item() <= tol * (p.abs().max().item() + 1e-2), n
    assert pinned, "offloaded masters must be pinned with pin_memory on a CUDA machine"
    if ratio == 1.0:  # the allocator holds no optimizer state and no fp32 master: they are in host memory
        assert table["optimizer_state"]["accelerator"] == table["fp32_master"]["accelerator"] == 0, table
    assert table["optimizer_state"]["host"] > 0
    assert table["total"]["accelerator"] <= allocated


def _offload_states_on_gpu(stage):
    """offload_states frees what it moves from the allocator, and reload_states brings it back bit for bit."""
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}}
    engine, _, _, _ = zero_ext.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = (t.cuda() for t in MLP.batch(4, gen, torch.bfloat16))
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    table = engine.memory_breakdown()
    moved = table["optimizer_state"]["accelerator"] + table["fp32_master"]["accelerator"]
    engine.offload_states(include=["optim_states", "hp_params"])
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    engine.reload_states()
    torch.cuda.synchronize()
    return before, after, moved, torch.cuda.memory_allocated()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_states_frees_the_allocators_bytes(stage):
    before, after, moved, reloaded = run_ranks(1, _offload_states_on_gpu, stage, timeout=300, init=False)[0]
    assert moved > 0
    assert before - after >= moved  # (the allocator rounds blocks up: at least what the account says moved)
    assert reloaded >= after + moved


def _prefetch_on_gpus(world):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": True}}
    engine, _, _, _ = zero_ext.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(0)
    rank = torch.distributed.get_rank()
    for _ in range(5):
        x, y = MLP.batch(4 * world, gen)
        x, y = x[4 * rank:4 * rank + 4].cuda(), y[4 * rank:4 * rank + 4].cuda()
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()
    stats = engine.zero_model.coordinator.stats.as_dict()
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    return params, stats


@pytest.mark.parametrize("world", [1, 2])
def test_stage_3_prefetch_on_gpus_matches_the_cpu_reference(world):
    # the asynchronous all-gathers run on ProcessGroupNCCL's stream and the compute stream waits on them
    # at wait(); two ranks need two GPUs (NCCL refuses two ranks on one device)
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = run_ranks(world, _prefetch_on_gpus, world, timeout=300, init=False)
    torch.manual_seed(0)
    ref = MLP()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = MLP.batch(4 * world, gen)
        sum((ref(x[4 * r:4 * r + 4]) - y[4 * r:4 * r + 4]).pow(2).mean() / world for r in range(world)).backward()
        opt.step()
        opt.zero_grad()
    for params, stats in results:
        assert stats["traced_steps"] >= 3 and stats["prefetched"] > 0 and stats["invalidations"] == 0
        for n, p in ref.named_parameters():
            assert (params[n] - p.detach()).abs().max().item() <= 1e-4 * (p.abs().max().item() + 1e-2), n
