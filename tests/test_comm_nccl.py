"""The NCCL transport behind the facade (zero_ext/comm/nccl.py over csrc/comm_nccl.c) and the cast kernel
on the engine's CUDA path (_native/cuda.cast_into).

Without a GPU (this development machine) only the CPU side runs: CPU collectives never reach the NCCL
transport, ZERO_EXT_COMM=torch keeps CUDA tensors off it, and the library exports what the transport
calls. The tests marked ``gpu`` (benchmarks/gpu_suite.sh) check the transport itself: every verb it
carries equals torch.distributed's result at world 1 (and 2 where two GPUs exist), an async op orders
the caller's stream, and the cast kernel writes what torch's copy writes.
"""
import ctypes

import pytest
import torch

from helpers.harness import run_ranks


def _cpu_verbs_with_nccl_forbidden():
    from zero_ext import comm
    from zero_ext.comm import nccl

    def refuse(*args, **kwargs):
        raise AssertionError("a CPU collective asked for the NCCL transport")
    nccl.for_group = refuse
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    t = torch.full((5,), float(rank))
    comm.all_reduce(t)
    g = torch.empty(world * 3)
    comm.all_gather_into_tensor(g, torch.full((3,), float(rank)))
    rs = torch.empty(2)
    comm.reduce_scatter_tensor(rs, torch.arange(2.0 * world))
    v = torch.empty(sum(range(1, world + 1)))
    comm.all_gather_v(v, torch.full((rank + 1,), float(rank)), list(range(1, world + 1)))
    b = torch.full((4,), float(rank))
    comm.broadcast(b, src=1)
    return comm.transport(), t.tolist(), g.tolist(), rs.tolist(), v.tolist(), b.tolist()


def test_cpu_collectives_never_reach_the_nccl_transport():
    for transport, t, g, rs, v, b in run_ranks(2, _cpu_verbs_with_nccl_forbidden):
        assert transport == "native shared memory"
        assert t == [1.0] * 5 and g == [0.0] * 3 + [1.0] * 3 and b == [1.0] * 4
        assert v == [0.0, 1.0, 1.0] and rs in ([0.0, 2.0], [4.0, 6.0])


def _nccl_route_under_torch_mode():
    from zero_ext.comm import nccl

    return nccl.for_group(None, torch.device("cuda", 0))


def test_zero_ext_comm_torch_keeps_cuda_tensors_on_torch_distributed():
    assert run_ranks(1, _nccl_route_under_torch_mode, env={"ZERO_EXT_COMM": "torch"}) == [None]


def test_the_library_exports_what_the_transport_and_the_engine_call():
    from zero_ext._native import cuda

    if not cuda.available():
        pytest.skip("built without the CUDA library (no nvcc or NCCL)")
    lib = ctypes.CDLL(cuda.LIBRARY)
    for name in ("zx_nccl_unique_id", "zx_nccl_comm_init", "zx_nccl_comm_abort", "zx_nccl_all_gather",
                 "zx_nccl_reduce_scatter", "zx_nccl_all_reduce", "zx_nccl_broadcast", "zx_nccl_group_start",
                 "zx_nccl_group_end", "zx_cuda_cast"):
        assert hasattr(lib, name), name
    assert not cuda.cast_into(torch.zeros(3, dtype=torch.bfloat16), torch.ones(3))  # CPU: torch copies


# --- on a GPU -------------------------------------------------------------------------------------


def _gpu_verbs():
    """Each verb on CUDA tensors through the facade (the NCCL transport) and the same through
    torch.distributed directly; integer-valued floats, so any reduction order gives the same sum."""
    import torch.distributed as dist

    from zero_ext import comm
    from zero_ext.comm import collectives, nccl

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    routed = type(collectives._route(None, torch.zeros(1, device=dev))).__name__
    out = {"routed": routed}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        base = (torch.arange(12, device=dev) + 100 * rank).to(dtype)
        t = base.clone()
        comm.all_reduce(t)
        mx = base.clone()
        comm.all_reduce(mx, op=comm.ReduceOp.MAX, async_op=True).wait()
        g = torch.empty(world * 12, dtype=dtype, device=dev)
        comm.all_gather_into_tensor(g, base)
        rs = torch.empty(3, dtype=dtype, device=dev)
        comm.reduce_scatter_tensor(rs, (torch.arange(3 * world, device=dev) + rank).to(dtype))
        b = base.clone()
        comm.broadcast(b, src=world - 1)
        v = torch.empty(sum(range(1, world + 1)), dtype=dtype, device=dev)
        comm.all_gather_v(v, torch.full((rank + 1,), float(rank), device=dev).to(dtype), list(range(1, world + 1)))
        outs = [torch.empty(world * n, dtype=dtype, device=dev) for n in (5, 1)]
        comm.all_gather_coalesced(outs, [torch.full((n,), float(rank), device=dev).to(dtype) for n in (5, 1)],
                                  async_op=True).wait()
        # an async op whose input the caller drops at once: record_stream keeps its memory until it ran
        w = comm.all_reduce(torch.full((1 << 20,), 1.0, device=dev, dtype=dtype), async_op=True)
        w.wait()
        ref_t = base.clone()
        dist.all_reduce(ref_t)
        ref_g = torch.empty_like(g)
        dist.all_gather_into_tensor(ref_g, base)
        out[str(dtype)] = [x.float().cpu().tolist() for x in (t, mx, g, rs, b, v, *outs)] + \
            [ref_t.float().cpu().tolist(), ref_g.float().cpu().tolist()]
    # the communicator's channel buffers, measured when it was made, are what the memory report counts
    made = nccl.for_group(None, dev)
    out_bytes = (made.buffer_bytes, nccl.buffer_bytes())
    nccl.destroy_all()
    out["buffers"] = [out_bytes, nccl.buffer_bytes()]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_collectives_run_on_the_nccl_transport_and_match_torch(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    for rank, out in enumerate(run_ranks(world, _gpu_verbs, timeout=300)):
        assert out.pop("routed") == "Nccl"
        (own, counted), after = out.pop("buffers")
        assert counted == own and after == 0
        assert own > 0 or world == 1  # NCCL takes device memory for the channels to its peers
        for dtype, values in out.items():
            t, mx, g, rs, b, v, o1, o2, ref_t, ref_g = values
            assert t == ref_t and g == ref_g, dtype
            assert mx == [float(i + 100 * (world - 1)) for i in range(12)]
            assert b == [float(i + 100 * (world - 1)) for i in range(12)]
            assert rs == [float(world * (3 * rank + i) + sum(range(world))) for i in range(3)]
            assert v == [float(r) for r in range(world) for _ in range(r + 1)]
            assert o1 == [float(r) for r in range(world) for _ in range(5)] and o2 == [float(r) for r in range(world)]


@pytest.mark.gpu
def test_cast_into_writes_what_torch_copy_writes():
    from zero_ext._native import cuda

    src = torch.cat([torch.tensor([0.0, -0.0, 1e-40, 3.4e38, float("inf"), 1.0 + 3 * 2 ** -9, 65520.0]),
                     torch.randn(100_003) * 10]).cuda()
    for dtype in (torch.bfloat16, torch.float16):
        dst = torch.empty(src.shape, dtype=dtype, device="cuda")
        assert cuda.cast_into(dst, src)
        want = torch.empty_like(dst).copy_(src)
        torch.cuda.synchronize()
        assert torch.equal(dst.view(torch.int16), want.view(torch.int16)), dtype
