"""The NVMe-offloaded optimizer step as the engine runs it, against CPU offload and the pure I/O time.

    python benchmarks/bench_nvme_engine_step.py --nvme-path /local_nvme        # ~200M params, one process
    python benchmarks/bench_nvme_engine_step.py --params 50e6 --steps 2

One process, ZeRO stage 3 by default (--stage 2: the partition is swapped in sub_group_size slices),
bf16, a stack of Linear(d, d) layers, AdamW through the engine's C optimizer.
Modes, each in its own engine, the same steps:
  cpu            offload_optimizer "cpu": masters and Adam state in host memory (no I/O)
  nvme           offload_optimizer "nvme", no pipelining: read group, step it, write it back, next
  nvme+pipeline  pipeline_read and pipeline_write: the next read and the last write overlap the update
For each nvme mode it also times the pure I/O of the same bytes: streaming every group through the
store with nothing done to it (read + write back). The store keeps a group's data in its buffer after
writing it back (a later use then needs no read), so the sub-groups must far outnumber buffer_count
for the figures to be I/O: the script refuses fewer than 3 x buffer_count sub-groups. The target (issue #8): the pipelined step within
1.2x of max(I/O, compute), compute being the cpu mode's step. Reported: engine.step() seconds, median
of the timed steps. Benchmarks decide nothing.
"""
import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=200e6, help="trainable parameters (approximate)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--sub-group-size", type=float, default=1e7, help="zero_optimization.sub_group_size")
    p.add_argument("--buffer-count", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nvme-path", default=None, help="directory on the drive to test (default: a temp dir)")
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3),
                   help="ZeRO stage (1/2: the partition is swapped in sub_group_size slices)")
    return p.parse_args()


def build_model(args) -> nn.Module:
    depth = max(1, round(args.params / (args.width * args.width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(depth)])


def config(args, mode: str, nvme_path: str) -> dict:
    off = {"device": "cpu"}
    if mode.startswith("nvme"):
        pipe = mode.endswith("pipeline")
        off = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": args.buffer_count,
               "pipeline_read": pipe, "pipeline_write": pipe}
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "aio": {"block_size": 1 << 20, "queue_depth": 32},
            "zero_optimization": {"stage": args.stage, "sub_group_size": int(args.sub_group_size),
                                  "stage3_param_persistence_threshold": 0, "offload_optimizer": off}}


def main():
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import zero_ext

    dist.init_process_group("gloo", rank=0, world_size=1)
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="bench_nvme_")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; swap files under {nvme_path}")
    rows = {}
    for mode in ("cpu", "nvme", "nvme+pipeline"):
        engine, _, _, _ = zero_ext.initialize(model=build_model(args), config=config(args, mode, nvme_path))
        x = torch.randn(4, args.width, dtype=torch.bfloat16)
        times = []
        for i in range(args.steps + 1):
            engine.backward(engine(x).float().pow(2).mean())
            t0 = time.perf_counter()
            engine.step()
            if i:  # the first step is a warm-up
                times.append(time.perf_counter() - t0)
        io = None
        opt = engine.optimizer
        if opt.nvme is not None:
            keys = opt.nvme.keys()  # sub-groups (stages 1/2: slices of the partition)
            io_times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                for _ in opt.nvme.stream(keys, *opt._pipeline):
                    pass
                io_times.append(time.perf_counter() - t0)
            io = statistics.median(io_times)
        groups = len(opt.nvme) if opt.nvme is not None else sum(
            len(opt.nvme_slices(g, int(args.sub_group_size))) for g in opt.flat_groups)
        if opt.nvme is not None and groups < 3 * args.buffer_count:
            raise SystemExit(f"{groups} sub-groups for {args.buffer_count} buffers: lower --sub-group-size")
        nbytes = sum(opt.nvme_file_bytes(g) for g in opt.flat_groups)
        rows[mode] = (statistics.median(times), io, groups, nbytes)
        engine.destroy()
    compute = rows["cpu"][0]
    print(f"\n{rows['cpu'][2]} sub-groups, {rows['cpu'][3] / 1e9:.2f} GB of masters + Adam state; "
          f"median of {args.steps} steps")
    print(f"{'mode':<15} {'step (s)':>9} {'I/O alone (s)':>14} {'GB/s (r+w)':>11} {'x max(I/O, compute)':>20}")
    for mode, (step, io, _, nbytes) in rows.items():
        if io is None:
            print(f"{mode:<15} {step:>9.3f} {'-':>14} {'-':>11} {'-':>20}")
            continue
        print(f"{mode:<15} {step:>9.3f} {io:>14.3f} {2 * nbytes / io / 1e9:>11.2f} {step / max(io, compute):>20.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
