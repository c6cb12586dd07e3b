"""A ZeRO-Offload training step as the engine runs it, phase by phase, against the same step without offload.

    python benchmarks/bench_offload_step.py                  # ~100M params, N=1 and N=2, ~3 min on 2 cores
    python benchmarks/bench_offload_step.py --params 30e6 --steps 3 --worlds 1

The model is a stack of Linear(d, d) + GELU layers in bf16 (``--params`` sets the depth at width
``--width``), trained at ZeRO stage 2 with gradient clipping at 1.0 and an AdamW ``optimizer`` section,
twice in the same processes, one step of each in turn (so load from other work on the machine falls on
both alike):
  offload   offload_optimizer.device "cpu": the engine builds zero_ext's C CPUAdam and steps it fused
            (unscale + clip on load, Adam, bf16 copy-out of the new parameters in one pass);
  device    no offload: torch.optim.AdamW on the fp32 masters on the compute device.
On a CPU-only machine host and compute device are the same memory, so the offloaded code path runs
unchanged but its copies are host-to-host: the table shows what the step's *structure* costs (which
phases exist, what the C step costs against torch's), not PCIe transfer times.

Phases are timed with time.perf_counter around the engine's calls and around the ZeroOptimizer's
internal phases, wrapped per instance by this script (the library has no timing code):
  forward                    engine(x) and the loss
  backward                   engine.backward(loss): autograd + stage 2's bucketed reduction, of which
    bucket copy + reduce       BucketReducer.flush minus the part below (copy grads into the bucket, reduce to owners)
    grad -> fp32 partition     BucketReducer._complete: accumulate the reduced run into the fp32 gradient
                               partition (the copy to host memory with offload)
  step                       engine.step(), of which
    ensure_reduced             wait for outstanding reductions
    grad_sq_norm               global gradient norm (an all-reduce with N > 1)
    optimizer (C fused)        offload: ZeroOptimizer._fused_step (CPUAdam.step + parameter upload)
    optimizer (torch)          device: torch AdamW.step on the fp32 masters
    master -> bf16 params      device: FlatGroup.copy_master_to_params
    all_gather_params          N > 1: every rank's new partition into every rank's parameters
    rest of step               unscale/clip multiply (device), bookkeeping
Each step is timed on every rank after a barrier; a phase's figure is the slower rank's, the table the
median over the timed steps. Ratios are offload / device from the same run.
This model's gradients vanish through its depth: after a few steps a fifth of exp_avg_sq is subnormal,
and on x86 every vector operation with a subnormal lane takes a microcode assist, in the C step and in
torch's AdamW alike. --flush-denormal runs with torch.set_flush_denormal(True) (which the C step follows)
to show the difference. Benchmarks decide nothing.
"""
import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from _spawn import spawn_ranks  # benchmarks/_spawn.py (this script's folder is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's zero_ext

MODES = ("offload", "device")
ROWS = [("forward", 0), ("backward", 0), ("bucket copy + reduce", 1), ("grad -> fp32 partition", 1),
        ("step", 0), ("ensure_reduced", 1), ("grad_sq_norm", 1), ("optimizer (C fused)", 1),
        ("optimizer (torch)", 1), ("master -> bf16 params", 1), ("all_gather_params", 1), ("rest of step", 1),
        ("total", 0)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=100e6, help="trainable parameters (approximate)")
    p.add_argument("--width", type=int, default=2048, help="d of each Linear(d, d)")
    p.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=4, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--worlds", default="1,2", help="comma-separated process counts (gloo)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per world size")
    p.add_argument("--flush-denormal", action="store_true",
                   help="torch.set_flush_denormal(True) in every rank (the C step follows the caller's mode)")
    return p.parse_args()


def build_model(args) -> nn.Module:
    torch.manual_seed(0)
    layers = max(1, round(args.params / (args.width * args.width + args.width)))
    body = []
    for _ in range(layers):
        body += [nn.Linear(args.width, args.width), nn.GELU()]
    return nn.Sequential(*body).to(torch.bfloat16)


def config(mode: str) -> dict:
    zero = {"stage": 2, "reduce_bucket_size": int(5e7), "allgather_bucket_size": int(5e7)}
    if mode == "offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}, "zero_optimization": zero}


class Phases:
    """Seconds per phase in the current step; ``wrap`` times an instance's method under a name."""

    def __init__(self):
        self.now = defaultdict(float)

    def wrap(self, obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.now[name] += time.perf_counter() - t0
        setattr(obj, attr, timed)  # an instance attribute: the class and other engines are untouched

    def take(self) -> dict:
        out, self.now = dict(self.now), defaultdict(float)
        return out


def instrument(engine, phases: Phases) -> None:
    opt = engine.optimizer
    for attr, name in (("ensure_reduced", "ensure_reduced"), ("grad_sq_norm", "grad_sq_norm"),
                       ("_fused_step", "optimizer (C fused)"), ("all_gather_params", "all_gather_params")):
        phases.wrap(opt, attr, name)
    if not opt._fused():
        phases.wrap(opt.optimizer, "step", "optimizer (torch)")
        for g in opt.flat_groups:
            phases.wrap(g, "copy_master_to_params", "master -> bf16 params")
    phases.wrap(opt.reducer, "flush", "flush")
    phases.wrap(opt.reducer, "_complete", "grad -> fp32 partition")


def one_step(engine, phases: Phases, x: torch.Tensor) -> dict:
    t0 = time.perf_counter()
    loss = engine(x).float().pow(2).mean()
    t1 = time.perf_counter()
    engine.backward(loss)
    t2 = time.perf_counter()
    engine.step()
    t3 = time.perf_counter()
    inner = phases.take()
    # flush completes its bucket itself (overlap_comm off); the end-of-backward flush and wait are
    # inside backward, so the reducer's two phases split backward's reduction exactly
    inner["bucket copy + reduce"] = inner.pop("flush", 0.0) - inner.get("grad -> fp32 partition", 0.0)
    step_parts = ("ensure_reduced", "grad_sq_norm", "optimizer (C fused)", "optimizer (torch)",
                  "master -> bf16 params", "all_gather_params")
    inner.update({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0})
    inner["rest of step"] = inner["step"] - sum(inner.get(k, 0.0) for k in step_parts)
    return inner


def worker(rank: int, world: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.set_flush_denormal(args.flush_denormal)
    import zero_ext

    dist.init_process_group("gloo")
    engines, phases = {}, {}
    for mode in MODES:
        model = build_model(args)
        engines[mode], _, _, _ = zero_ext.initialize(model=model, config=config(mode))
        phases[mode] = Phases()
        instrument(engines[mode], phases[mode])
    kinds = {m: type(e.basic_optimizer).__name__ for m, e in engines.items()}
    gen = torch.Generator().manual_seed(100 + rank)
    times = {m: [] for m in MODES}
    for i in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.width, generator=gen).to(torch.bfloat16)
        for mode in MODES:
            dist.barrier()
            got = one_step(engines[mode], phases[mode], x)
            if i >= args.warmup:
                times[mode].append(got)
    # the slower rank's figure, phase by phase and step by step
    names = [n for n, _ in ROWS]
    out = {}
    for mode in MODES:
        t = torch.tensor([[s.get(n, 0.0) for n in names] for s in times[mode]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[mode] = {n: statistics.median(t[:, j].tolist()) for j, n in enumerate(names)}
    numel = sum(p.numel() for p in engines["offload"].module.parameters())
    state = engines["offload"].basic_optimizer.state.values()
    v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in state])
    subnormal = float(((v != 0) & (v.abs() < torch.finfo(torch.float32).tiny)).double().mean())
    if rank == 0:
        queue.put({"phases": out, "kinds": kinds, "params": numel, "subnormal": subnormal,
                   "threads": (torch.get_num_threads(), zero_ext.ops.get_num_threads())})
    for e in engines.values():
        e.destroy()
    dist.destroy_process_group()


def run_world(world: int, args) -> dict:
    return spawn_ranks(worker, (world, args), world, args.timeout, f"N={world}")[0]


def print_table(world: int, r: dict, args) -> None:
    off, dev = r["phases"]["offload"], r["phases"]["device"]
    print(f"\nN={world} (gloo), {r['threads'][0]} torch / {r['threads'][1]} zero_ext threads per rank; "
          f"{r['params'] / 1e6:.1f}M params bf16, stage 2, clip 1.0; {args.batch} x {args.width} input rows per rank; "
          f"median of {args.steps} steps after {args.warmup} warm-up; optimizers: offload "
          f"{r['kinds']['offload']}, device {r['kinds']['device']}")
    head = ["phase (s)", "offload", "device", "offload / device"]
    body = []
    for name, indent in ROWS:
        a, b = off.get(name, 0.0), dev.get(name, 0.0)
        if a == 0.0 and b == 0.0:
            continue
        ratio = f"{a / b:.2f}" if b > 1e-6 and a > 1e-6 else "-"
        body.append(["  " * indent + name, f"{a:.3f}" if a else "-", f"{b:.3f}" if b else "-", ratio])
    opt_ratio = off["optimizer (C fused)"] / max(1e-9, dev["optimizer (torch)"] + dev["master -> bf16 params"])
    widths = [max(len(row[i]) for row in body + [head]) for i in range(len(head))]
    for row in [head, ["-" * w for w in widths]] + body:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    print(f"C fused step / (torch AdamW step + bf16 copy): {opt_ratio:.2f}; "
          f"step share of total: offload {off['step'] / off['total']:.0%}, device {dev['step'] / dev['total']:.0%}")
    print(f"exp_avg_sq subnormal after the run (rank 0): {r['subnormal']:.1%}"
          + ("; flush to zero on" if args.flush_denormal else
             " (each vector op on one takes a microcode assist; see --flush-denormal)"))


def main():
    args = parse_args()
    print(f"load average at start {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)"
          + (": other work competes for the cores, times are noisy" if os.getloadavg()[0] > 0.5 else ""))
    for world in (int(w) for w in args.worlds.split(",")):
        t0 = time.perf_counter()
        r = run_world(world, args)
        print_table(world, r, args)
        print(f"(N={world}: {time.perf_counter() - t0:.0f} s with start-up)", flush=True)


if __name__ == "__main__":
    main()
