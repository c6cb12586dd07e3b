"""Collectives on CPU tensors: the native shared-memory transport against torch.distributed's gloo and a
memcpy floor, 2 ranks on this host, measured in the same run.

    python benchmarks/bench_comm.py [--world 2] [--max-mib 256] [--repeat 5] [--dtypes fp32,bf16]

For each verb and size (the full tensor: the all-gather's output, the reduce-scatter's input, the
all-reduce's buffer) every rank starts from a barrier and the slower rank's time counts; the table shows
the best of `repeat` (the least disturbed by other processes), each timing running the op back to back
until about 16 MiB went through (one call from 16 MiB up), so small sizes are not timed by the skew
with which the ranks leave the barrier before it. The floor is both ranks copying `size`
bytes at once (the least any of the three must move per rank: an all-gather writes its output, a
reduce-scatter reads every rank's part, an all-reduce both). Ratios: gloo / native (how many times
faster native is) and floor / native (the fraction of the memory-bound speed native reaches), beside
the most of it a transport that copies through shared memory can reach for that verb (docs/comm.md).
Targets (issue 18): from 4 MiB up, >= 3x gloo and >= 0.6x the floor.

Then one line for the state routines (safe_get_full_*): a full read of a `--state-mib` (64 MiB) fp32
parameter split over the ranks' partitions, natively (comm/fragments.py: an all-gather-v of the
fragments, in C) against what it replaced (a zero-filled full buffer holding this rank's fragment,
all-reduced: on the native transport and on gloo).
"""
import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _spawn import spawn_ranks  # noqa: E402

MiB = 2 ** 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # gloo: outside the timed region
    return t.item()


def _time(fn, repeat: int, inner: int = 1) -> float:
    """Seconds per call: the best of `repeat` timings of `inner` calls back to back (after a warm-up),
    each started at a barrier, the slower rank's time counting. Several calls per timing keep the
    ranks' skew leaving the (gloo) barrier from being counted as the op's time for small sizes."""
    best = float("inf")
    for _ in range(repeat + 1):  # the first is a warm-up (page faults, first-touch of slots)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, _slowest((time.perf_counter() - start) / inner))
    return best


def _state_read(rank, world, mib, repeat, native):
    """A full read of one fp32 parameter of `mib` MiB laid over the ranks' flat partitions (stage 1/2)."""
    from zero_ext.comm.fragments import FLAT, Fragments

    numel = int(mib * MiB) // 4
    numel -= numel % (2 * world)
    part = numel // world
    frags = Fragments(FLAT, numel, 0, part, world, rank)
    partition = torch.randn(part)
    at = frags.param_at[rank]

    def old(all_reduce):
        out = torch.zeros(numel)
        out[at:at + frags.length] = frags.real(partition)
        all_reduce(out)
        return out
    new = frags.gather(partition)
    assert torch.equal(new, old(lambda t: native.all_reduce(t, dist.ReduceOp.SUM)))
    return {"state_mib": mib,
            "native": _time(lambda: frags.gather(partition), repeat),
            "old_native": _time(lambda: old(lambda t: native.all_reduce(t, dist.ReduceOp.SUM)), repeat),
            "old_gloo": _time(lambda: old(dist.all_reduce), repeat)}


def _bound(verb: str, n: int) -> float:
    """The floor's 2C of memory traffic over what the verb moves per rank through shared memory at n ranks
    (C the full tensor; docs/comm.md, "What bounds each verb"): the most of the floor it can reach."""
    if n == 1:
        return 1.0
    per_rank = {"all_gather": 2 * n + 2, "reduce_scatter": 3 * n - 1, "all_reduce": 5 * n - 2}[verb] / n
    return 2 / per_rank


def _worker(rank, world, sizes, dtypes, repeat, state_mib, wanted, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    from zero_ext.comm import native as native_comm

    native = native_comm.for_group()
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for size in sizes:
            n = size // torch.tensor([], dtype=dtype).element_size()
            n -= n % world
            full, part = torch.randn(n).to(dtype), torch.randn(n // world).to(dtype)
            src, dst = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
            src.fill_(1)
            inner = max(1, (16 * MiB) // size)  # about 16 MiB moved per timing
            row = {"dtype": dname, "size": size, "floor": _time(lambda: dst.copy_(src), repeat, inner)}
            verbs = {
                "all_gather": (lambda: native.all_gather_into(full, part),
                               lambda: dist.all_gather_into_tensor(full, part)),
                "reduce_scatter": (lambda: native.reduce_scatter_tensor(part, full, dist.ReduceOp.SUM),
                                   lambda: dist.reduce_scatter_tensor(part, full)),
                "all_reduce": (lambda: native.all_reduce(full, dist.ReduceOp.SUM),
                               lambda: dist.all_reduce(full)),
            }
            for verb, (nat, gloo) in ((v, f) for v, f in verbs.items() if v in wanted):
                try:
                    g = _time(gloo, repeat, inner)
                except RuntimeError:  # gloo lacks reduce_scatter in some builds
                    g = float("nan")
                row[verb] = (_time(nat, repeat, inner), g)
            rows.append(row)
    rows.append(_state_read(rank, world, state_mib, repeat, native))
    if rank == 0:
        queue.put(rows)
    native_comm.destroy_all()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--max-mib", type=float, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--state-mib", type=float, default=64)
    ap.add_argument("--verbs", default="all_gather,reduce_scatter,all_reduce")
    args = ap.parse_args()
    sizes, s = [], 64 * 1024
    while s <= args.max_mib * MiB:
        sizes.append(s)
        s *= 4
    rows = spawn_ranks(_worker, (args.world, sizes, args.dtypes.split(","), args.repeat, args.state_mib,
                        args.verbs.split(",")), args.world,
                       timeout=3600, label="bench_comm")[0]
    print(f"{args.world} ranks; times in ms (best of {args.repeat}); x gloo = gloo / native; "
          f"x floor = floor / native; bound = the most x floor a two-copy transport allows (docs/comm.md)")
    print(f"{'dtype':5} {'size':>9} {'floor':>8} | {'verb':>14} {'native':>8} {'gloo':>8} {'x gloo':>6} "
          f"{'x floor':>7} {'bound':>5}")
    state = rows.pop()
    for r in rows:
        for verb in (v for v in ("all_gather", "reduce_scatter", "all_reduce") if v in r):
            nat, gloo = r[verb]
            size = f"{r['size'] / MiB:g} MiB"
            print(f"{r['dtype']:5} {size:>9} {r['floor'] * 1e3:8.2f} | {verb:>14} {nat * 1e3:8.2f} "
                  f"{gloo * 1e3:8.2f} {gloo / nat:6.2f} {r['floor'] / nat:7.2f} {_bound(verb, args.world):5.2f}")


    print(f"\nfull read of a {state['state_mib']:g} MiB fp32 parameter (safe_get_full_*): native all-gather-v of "
          f"fragments {state['native'] * 1e3:.2f} ms; before: zero-filled all-reduce native "
          f"{state['old_native'] * 1e3:.2f} ms ({state['old_native'] / state['native']:.2f}x), gloo "
          f"{state['old_gloo'] * 1e3:.2f} ms ({state['old_gloo'] / state['native']:.2f}x)")


if __name__ == "__main__":
    main()
