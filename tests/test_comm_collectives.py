"""The collective facade's one addition to torch.distributed: all_gather_into, with the list-form fallback
for backends without all_gather_into_tensor, gives the same rank-major result either way (also when the
input is a view of the output, as the engine passes it). Also: blocking calls stay on the caller's thread,
the reduce-scatter fallbacks, and the registry of native communicators survives a group's finalizer
firing inside its lock."""
import torch

from helpers.harness import run_ranks


def _gather_both_ways():
    from zero_ext.comm import collectives

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = []
    for forced_list in (False, True):
        collectives._LIST_ALLGATHER = forced_list
        out = torch.zeros(world * 3)
        own = out.view(world, 3)[rank]
        own.copy_(torch.arange(3) + 10 * rank)
        collectives.all_gather_into(out, own)
        later = torch.zeros(world * 3)
        collectives.all_gather_into(later, torch.arange(3.0) + 10 * rank, async_op=True).wait()
        results.append((out.tolist(), later.tolist()))
    collectives._LIST_ALLGATHER = False
    return results


def test_all_gather_into_is_rank_major_with_and_without_the_fallback():
    for tensor_form, list_form in run_ranks(2, _gather_both_ways):
        want = [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
        assert tensor_form == list_form == (want, want)


def _facade_calls():
    """Each verb of the facade on small tensors (integer-valued floats: exact in any sum order),
    contiguous and not, sync and async; the results and the transport."""
    from zero_ext import comm

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {"transport": comm.transport()}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        base = (torch.arange(12) + 100 * rank).to(dtype)
        t = base.clone()
        comm.all_reduce(t)
        m = base.clone()
        comm.all_reduce(m, op=comm.ReduceOp.MAX, async_op=True).wait()
        strided = base.clone().view(3, 4).t()  # not contiguous
        comm.all_reduce(strided)
        g = torch.empty(world * 12, dtype=dtype)
        comm.all_gather_into_tensor(g, base)
        parts = [torch.empty(12, dtype=dtype) for _ in range(world)]
        comm.all_gather(parts, base)
        rs = torch.empty(3, dtype=dtype)
        comm.reduce_scatter_tensor(rs, torch.arange(3 * world).to(dtype) + rank)
        rsl = torch.empty(3, dtype=dtype)
        comm.reduce_scatter(rsl, [torch.full((3,), float(r + rank)).to(dtype) for r in range(world)])
        b = base.clone()
        comm.broadcast(b, src=world - 1)
        red = base.clone()
        comm.reduce(red, dst=0)
        sc = torch.empty(2, dtype=dtype)
        comm.scatter(sc, [torch.full((2,), float(r)).to(dtype) for r in range(world)] if rank == 0 else None, src=0)
        v = torch.empty(sum(range(1, world + 1)), dtype=dtype)
        comm.all_gather_v(v, torch.full((rank + 1,), float(rank)).to(dtype), list(range(1, world + 1)))
        outs = [torch.empty(world * n, dtype=dtype) for n in (5, 1)]
        comm.all_gather_coalesced(outs, [torch.full((n,), float(rank)).to(dtype) for n in (5, 1)],
                                  async_op=True).wait()
        comm.barrier()
        out[str(dtype)] = [x.float().tolist() for x in (t, m, strided, g, *parts, rs, rsl, b, sc, v, *outs)] + \
            ([red.float().tolist()] if rank == 0 else [])
    return out


def test_the_facade_gives_the_same_results_on_both_transports():
    for world in (2, 3):
        native = run_ranks(world, _facade_calls)
        on_torch = run_ranks(world, _facade_calls, env={"ZERO_EXT_COMM": "torch"})
        for rank in range(world):
            assert native[rank].pop("transport") == "native shared memory"
            assert on_torch[rank].pop("transport") == "torch.distributed"
            assert native[rank] == on_torch[rank], f"world {world}, rank {rank}"


def _ops_handed_to_the_progress_thread():
    """How many of the facade's blocking calls, then of its async ones, the native communicator's
    progress thread ran (a blocking call runs its op on the caller's thread: no wake-up, no hand-over)."""
    from zero_ext import comm
    from zero_ext.comm import native

    comm.barrier()
    communicator = native.for_group().comm
    before = communicator.handed_off
    t = torch.ones(4096)
    for _ in range(20):
        comm.all_reduce(t)
        comm.all_gather_into_tensor(torch.empty(2 * 4096), t)
        comm.reduce_scatter_tensor(torch.empty(2048), t)
        comm.broadcast(t, src=0)
        comm.barrier()
    blocking = communicator.handed_off - before
    works = [comm.all_reduce(torch.ones(4096), async_op=True) for _ in range(4)]
    for w in works:
        w.wait()
    return blocking, t[0].item()


def test_blocking_facade_calls_run_on_the_callers_thread():
    for blocking, value in run_ranks(2, _ops_handed_to_the_progress_thread):
        assert blocking == 0
        assert value == 2.0 ** 20  # each round's all-reduce doubles t; broadcast keeps rank 0's


def _reduce_scatter_without_gloo_support():
    """The torch transport's reduce-scatter where gloo has none (torch < 2.6): all-reduce, keep the chunk."""
    from zero_ext.comm import collectives

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    inp = torch.arange(4 * world, dtype=torch.float32) * (rank + 1)
    out, later = torch.empty(4), torch.empty(2, 2)
    collectives._reduce_scatter_by_all_reduce(out, inp, collectives.ReduceOp.SUM, None, False)
    collectives._reduce_scatter_by_all_reduce(later, inp, collectives.ReduceOp.SUM, None, True).wait()
    return out.tolist(), later.reshape(-1).tolist()


def test_reduce_scatter_falls_back_to_an_all_reduce_where_gloo_lacks_it():
    for world in (2, 3):
        total = sum(range(1, world + 1))  # rank r's input is (r + 1) * arange
        for rank, (out, later) in enumerate(run_ranks(world, _reduce_scatter_without_gloo_support,
                                                       env={"ZERO_EXT_COMM": "torch"})):
            want = [total * float(i) for i in range(4 * rank, 4 * rank + 4)]
            assert out == later == want


def _reduce_scatter_fn():
    import deepspeed.comm as dist  # the compat package's name for zero_ext.comm itself

    from zero_ext import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    out = torch.empty(3)
    dist.reduce_scatter_fn(out, torch.arange(3.0 * world) + rank)
    return dist is comm, out.tolist()


def test_deepspeeds_reduce_scatter_fn_through_deepspeed_comm():
    world = 2
    for rank, (same, got) in enumerate(run_ranks(world, _reduce_scatter_fn)):
        assert same  # replacing deepspeed.comm.X replaces what zero_ext calls, as in DeepSpeed
        assert got == [sum(3 * rank + i + r for r in range(world)) for i in range(3)]


def _group_freed_while_the_registry_is_locked():
    """The collector runs a freed group's finalizer on whatever thread allocates, also on one inside
    native.for_group's locked bootstrap (a pooled test run once hung there in initialize): that finalizer
    takes the same lock. Here it fires on purpose with the lock held; (finished, communicator destroyed)."""
    import gc
    import threading

    import torch.distributed as dist
    from zero_ext.comm import native

    box = [dist.new_group(list(range(dist.get_world_size())))]
    communicator = native.for_group(box[0])
    assert communicator is not None
    finished = threading.Event()

    def free_the_group():
        with native._LOCK:
            dist.destroy_process_group(box.pop())
            gc.collect()
        finished.set()

    threading.Thread(target=free_the_group, daemon=True).start()
    finished.wait(20)
    return finished.is_set(), communicator.comm.destroyed


def test_a_group_freed_inside_the_registrys_lock_does_not_deadlock():
    assert run_ranks(2, _group_freed_while_the_registry_is_locked) == [(True, True)] * 2
