"""Step time and memory per rank: zero_ext's ZeRO stages against torch DDP and FSDP2, CPU gloo, 2 ranks.

    python benchmarks/bench_step.py [--steps 8] [--warmup 2] [--configs z1,z2]

The model is demo/model.py's GPT at ~19M parameters (d 512, 6 layers, byte vocabulary), fp32, AdamW,
gradient clipping at 1.0, the same random batches for every configuration. The config's AdamW runs on
zero_ext's C kernel (CPU tensors); a "-torch" configuration sets ``torch_adam: true`` (torch.optim.AdamW,
what the engine ran before the kernel became its default on CPU), so the two are compared in one run.
Beside the whole step, two parts of it are timed: the optimizer phase, engine.step() (at stages 0/1 the
gradient reduction, then norm, clip, update, all-gather), for DDP/FSDP2 clip_grad_norm_ + optimizer.step();
and inside it the update alone, the base optimizer's step() (timed by its step hooks). Each configuration runs in
a fresh pair of spawned processes, so ru_maxrss is that configuration's own peak. A step's time is the
slower rank's (both start from a barrier); the table shows the best of the timed steps (the least
disturbed by other processes on the machine) and their median. Ratios are
against DDP measured in the same run, never against numbers from another day. Every stage the config
accepts is measured, and PyTorch FSDP2 (fully_shard per block and at the root) beside stage 3.

With ``--ds-python <venv>/bin/python`` (a venv where DeepSpeed 0.19.x is installed) the real DeepSpeed
runs the same model, batches and config at stages 1-3 as "ds-z1".."ds-z3" (bench_step_ds.py: CPU
accelerator, gloo; zero_ext's own `deepspeed` compatibility package is refused by name).
``--rounds N`` runs every configuration N times, interleaved (ddp, z1, ..., ds-z3, then again), and
reports per configuration the median over rounds of each round's median step (best: the best step of
all rounds), with a line checking issue 18's targets on those medians.
"""
import json
import subprocess
import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's zero_ext, and the demo's model

import zero_ext  # noqa: E402
from demo.model import GPT, count_params, lm_loss  # noqa: E402
from zero_ext.config import UnimplementedFeatureError, reject_unimplemented  # noqa: E402
from zero_ext.zero import fetch as zero_fetch  # noqa: E402

from _spawn import spawn_ranks  # noqa: E402 (benchmarks/_spawn.py; this script's folder is on sys.path)

WORLD = 2
MiB = 2 ** 20
# DDP's default bucket (bucket_cap_mb=25) in fp32 elements; zero_ext's buckets get the same size
BUCKET = 25 * MiB // 4
LR = 1e-4


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--configs", default=None, help="comma-separated subset of " + ",".join(ZERO_CONFIGS))
    p.add_argument("--timeout", type=float, default=240, help="seconds per configuration")
    p.add_argument("--ds-python", default=os.environ.get("ZERO_EXT_DS_PYTHON"),
                   help="Python of a venv with DeepSpeed installed: adds DeepSpeed's stages 1-3")
    p.add_argument("--rounds", type=int, default=1, help="interleaved runs of every configuration")
    return p.parse_args()


# name -> (ZeRO stage, overlap_comm); overlap_comm None is DeepSpeed's default (on for stage 3 only).
# "-nocheck": without the fetch-order agreement (ZERO_EXT_CHECK_FETCH_ORDER=0); "-torch": torch_adam
ZERO_CONFIGS = {"z0": (0, None), "z1": (1, None), "z1-torch": (1, None), "z2": (2, None), "z2-torch": (2, None),
                "z2-overlap": (2, True), "z3": (3, None), "z3-torch": (3, None), "z3-nocheck": (3, None)}


def zero_config(name: str, batch: int = 1) -> dict:
    stage, overlap = ZERO_CONFIGS[name]
    zero = {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    if overlap is not None:
        zero["overlap_comm"] = overlap
    params = {"lr": LR, "weight_decay": 0.01, **({"torch_adam": True} if name.endswith("-torch") else {})}
    return {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero}


def accepted_configs():
    out = []
    for name in ZERO_CONFIGS:
        try:
            reject_unimplemented(zero_config(name))
            out.append(name)
        except UnimplementedFeatureError:
            pass
    return out


def build_model(block: int) -> GPT:
    torch.manual_seed(0)
    return GPT(256, d=512, heads=8, layers=6, block=block)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# -- the trainers: each returns (step(x, y) -> seconds in the optimizer phase, tensor_bytes(), base optimizer) --

def ddp_trainer(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    # grads as views of DDP's buckets: no second copy of the gradients, so params + grads + Adam state
    # is what DDP holds
    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def step(x, y):
        lm_loss(ddp(x), y).backward()
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return time.perf_counter() - t0

    def tensor_bytes():
        tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
        tensors += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        return sum(t.numel() * t.element_size() for t in tensors)
    return step, tensor_bytes, opt


def fsdp2_trainer(model):
    """PyTorch FSDP2 (fully_shard, each transformer block then the root) on the same model: the
    peer zero_ext's stage 3 is measured against."""
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def step(x, y):
        lm_loss(model(x), y).backward()
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    def tensor_bytes():
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        tensors = local + [t.to_local() if hasattr(t, "to_local") else t
                           for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        return sum(t.numel() * t.element_size() for t in tensors)
    return step, tensor_bytes, opt


def zero_trainer(model, name: str, batch: int):
    engine, _, _, _ = zero_ext.initialize(model=model, config=zero_config(name, batch))

    def step(x, y):
        engine.backward(lm_loss(engine(x), y))
        t0 = time.perf_counter()
        engine.step()
        return time.perf_counter() - t0

    def tensor_bytes():
        return sum(engine.memory_breakdown()["total"].values())
    return step, tensor_bytes, engine.basic_optimizer


class UpdateClock:
    """Seconds the base optimizer spends in step(), the update alone (its step hooks)."""

    def __init__(self, opt):
        self.total, self.t0 = 0.0, 0.0
        opt.register_step_pre_hook(self._start)
        opt.register_step_post_hook(self._stop)

    def _start(self, opt, args, kwargs):
        self.t0 = time.perf_counter()

    def _stop(self, opt, args, kwargs):
        self.total += time.perf_counter() - self.t0

    def take(self) -> float:
        t, self.total = self.total, 0.0
        return t


def worker(rank: int, name: str, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    if name.endswith("-nocheck"):
        os.environ["ZERO_EXT_CHECK_FETCH_ORDER"] = "0"  # measures what the agreement costs per step
    dist.init_process_group("gloo")
    baseline = rss_mib()
    model = build_model(args.block)
    if name == "ddp":
        step, tensor_bytes, optimizer = ddp_trainer(model)
    elif name == "fsdp2":
        step, tensor_bytes, optimizer = fsdp2_trainer(model)
    else:
        step, tensor_bytes, optimizer = zero_trainer(model, name, args.batch)
    gen = torch.Generator().manual_seed(100 + rank)  # the same batches for every configuration
    clock = UpdateClock(optimizer)
    times, opt_times, updates, cpus = [], [], [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            agreements = zero_fetch.agreements()
        x = torch.randint(0, 256, (args.batch, args.block + 1), generator=gen)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opt_times.append(step(x[:, :-1], x[:, 1:]))
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        updates.append(clock.take())
    # the slower rank's time, step by step
    timed = torch.tensor([times[args.warmup:], opt_times[args.warmup:], updates[args.warmup:], cpus[args.warmup:]],
                         dtype=torch.float64)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)
    queue.put({"rank": rank, "times": timed[0].tolist(), "opt_times": timed[1].tolist(), "updates": timed[2].tolist(),
               "cpus": timed[3].tolist(),
               "rss": rss_mib(), "baseline": baseline, "optimizer": type(optimizer).__name__,
               "tensors": tensor_bytes(), "params": count_params(model),
               "agreements": (zero_fetch.agreements() - agreements) / args.steps})
    dist.destroy_process_group()


def run_config(name: str, args):
    results = sorted(spawn_ranks(worker, (name, args), WORLD, args.timeout, name, results=WORLD),
                     key=lambda r: r["rank"])
    return {"step": statistics.median(results[0]["times"]), "best": min(results[0]["times"]),
            "opt": statistics.median(results[0]["opt_times"]), "opt_best": min(results[0]["opt_times"]),
            "update": statistics.median(results[0]["updates"]), "update_best": min(results[0]["updates"]),
            "cpu": statistics.median(results[0]["cpus"]), "optimizer": results[0]["optimizer"],
            "rss": [r["rss"] for r in results], "baseline": [r["baseline"] for r in results],
            "tensors": [r["tensors"] for r in results], "params": results[0]["params"],
            "agreements": results[0]["agreements"]}


DS_CONFIGS = {"ds-z1": "z1", "ds-z2": "z2", "ds-z3": "z3"}


def run_deepspeed(name: str, args):
    """One DeepSpeed configuration in the DeepSpeed venv (bench_step_ds.py), as run_config's dict."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_step_ds.py")
    cmd = [args.ds_python, script, "--name", DS_CONFIGS[name], "--config",
           json.dumps(zero_config(DS_CONFIGS[name], args.batch)), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--batch", str(args.batch), "--block", str(args.block), "--timeout", str(args.timeout)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # this checkout's compat package stays out
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 600, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def combine(runs):
    """Rounds of one configuration: medians of the rounds' medians, bests of their bests."""
    out = dict(runs[-1])
    for key in ("step", "opt", "update", "cpu"):
        out[key] = statistics.median(r[key] for r in runs)
    for key in ("best", "opt_best", "update_best"):
        out[key] = min(r[key] for r in runs)
    out["rounds"] = [r["step"] for r in runs]
    return out


def print_targets(rows) -> None:
    """Issue 18's targets on the median steps (2 gloo ranks, fp32)."""
    def ratio(a, b, key="step"):
        return rows[a][key] / rows[b][key] if a in rows and b in rows else float("nan")
    checks = [("z3", "ddp", 1.15), ("z3", "ds-z3", 0.8), ("z3", "fsdp2", 0.7), ("z1", "ddp", 1.05),
              ("z2", "ddp", 1.05), ("z1", "ds-z1", None), ("z2", "ds-z2", None)]
    parts = []
    for a, b, target in checks:
        r = ratio(a, b)
        if r == r:
            parts.append(f"{a}/{b} {r:.2f} (CPU {ratio(a, b, 'cpu'):.2f})" + (
                f" (target <= {target}: {'met' if r <= target else 'NOT met'})" if target else ""))
    print("median step ratios, wall (CPU time): " + "; ".join(parts))


def print_table(rows, args) -> None:
    ref = rows["ddp"]
    params = ref["params"]
    print(f"\nCPU gloo, {WORLD} ranks, 1 thread each; GPT {params / 1e6:.1f}M params fp32, AdamW, clip 1.0; "
          f"{args.batch} x {args.block} tokens per rank per step; best and median of {args.steps} timed "
          f"steps after {args.warmup} warm-up")
    head = ["config", "optimizer", "step (s): best (median)", "vs DDP", "step CPU s", "vs DDP", "optimizer phase (s)", "vs DDP",
            "update (s)", "vs DDP", "peak RSS MiB per rank", "tensor MiB per rank", "vs DDP"]
    body = []
    for name, r in rows.items():
        body.append([name, r["optimizer"], f"{r['best']:.3f} ({r['step']:.3f})", f"{r['best'] / ref['best']:.2f}",
                     f"{r['cpu']:.3f}", f"{r['cpu'] / ref['cpu']:.2f}",
                     f"{r['opt_best']:.3f} ({r['opt']:.3f})", f"{r['opt_best'] / ref['opt_best']:.2f}",
                     f"{r['update_best']:.3f} ({r['update']:.3f})", f"{r['update_best'] / ref['update_best']:.2f}",
                     " / ".join(f"{x:.0f}" for x in r["rss"]),
                     " / ".join(f"{x / MiB:.1f}" for x in r["tensors"]),
                     f"{max(r['tensors']) / max(ref['tensors']):.2f}"])
    widths = [max(len(row[i]) for row in body + [head]) for i in range(len(head))]
    for row in [head, ["-" * w for w in widths]] + body:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    checked = [f"{name} {r['agreements']:.0f}" for name, r in rows.items() if name.startswith("z3")]
    if checked:
        print("fetch-order agreements per step (ZeRO-3; one small all-gather each): " + ", ".join(checked))
    base = max(b for r in rows.values() for b in r["baseline"])
    load = f"{args.load:.1f} ({os.cpu_count()} CPUs): " + (
        "other work competes for the cores, so times are noisy" if args.load > 0.5 else "quiet")
    print(f"""
notes:
- load average at start {load}.
- step CPU s: the median over steps of the slower rank's process CPU time in the step (every thread:
  compute, the transport's copies and waits, gloo's threads); less disturbed by other processes than wall
  time, which is what to compare on a busy machine.
- per rank = rank 0 / rank 1. Peak RSS includes the interpreter with torch and zero_ext imported
  ({base:.0f} MiB before the model is built) and each step's transient tensors (activations, autograd's
  gradients, the optimizer's temporaries), which tensor MiB does not count.
- tensor MiB, after the last step: zero_ext's engine.memory_breakdown() total; DDP's params + grads + AdamW
  state (DDP runs with gradient_as_bucket_view=True, so its buckets are the grads). Unsharded fp32 Adam is
  16 bytes/param = {16 * params / MiB:.1f} MiB.
- optimizer: the base optimizer's class (CPUAdam: zero_ext's C kernel; AdamW: torch.optim's).
- buckets: DDP's 25 MiB; zero_ext reduce/allgather_bucket_size {BUCKET:,} elements (the same 25 MiB in fp32);
  overlap_comm is DeepSpeed's default (off) except in z2-overlap, which alternates two bucket buffers.
- on gloo, stage 2's reduce-to-owner is one dist.reduce per owner per bucket, and stage 1 emulates
  reduce-scatter with an all-reduce of which each rank keeps its partition (twice a reduce-scatter's traffic).""")


def main():
    args = parse_args()
    args.load = os.getloadavg()[0]
    names = ["ddp"] + accepted_configs() + ["fsdp2"] + (list(DS_CONFIGS) if args.ds_python else [])
    if args.configs:
        wanted = args.configs.split(",")
        names = ["ddp"] + [n for n in names if n in wanted and n != "ddp"]  # ratios need DDP
    runs = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            t0 = time.perf_counter()
            row = run_deepspeed(name, args) if name in DS_CONFIGS else run_config(name, args)
            runs[name].append(row)
            print(f"round {round_ + 1} {name}: median {row['step']:.3f} best {row['best']:.3f} s/step "
                  f"({time.perf_counter() - t0:.0f} s with start-up; load {os.getloadavg()[0]:.1f})", flush=True)
    rows = {name: combine(r) for name, r in runs.items()}
    print_table(rows, args)
    if args.rounds > 1:
        print("per-round median steps: " + "; ".join(
            f"{n} " + "/".join(f"{x:.3f}" for x in r["rounds"]) for n, r in rows.items()))
    print_targets(rows)


if __name__ == "__main__":
    main()
