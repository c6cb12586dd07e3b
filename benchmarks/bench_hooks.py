"""ZeRO-3 hook overhead per module per step, on a model of many small modules (1 process, gloo).

    python benchmarks/bench_hooks.py [--modules 200] [--steps 20]

A chain of small Linear layers (16 x 16), so compute is tiny and the per-module cost of fetching and
releasing dominates. Measured in the same run: plain PyTorch (forward + backward + AdamW), PyTorch's
FSDP2 (``fully_shard`` on each Linear, then on the root: the same per-module gather and release), and
the zero_ext stage 3 engine with and without the fetch-order agreement, and with the write guard off
(guard.py: a partitioned parameter's class refuses in-place writes; here its parameters keep their own
class). Prints microseconds per module per step above plain PyTorch (a Linear and a Tanh count as two
modules), and the ratio to FSDP2's; then the write guard's own cost, timed alone: the two class
assignments of one gather and release, times the parameters gathered per step.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zero_ext  # noqa: E402
from zero_ext.zero import fetch  # noqa: E402


def model(n):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(n)])


def fsdp2_step(n, x):
    """FSDP2 on the same model: fully_shard per Linear and on the root (None where torch lacks it)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            return None
    m = model(n)
    for layer in m:
        fully_shard(layer[0])
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def step():
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return step


def unguard(engine):
    """The write guard off for this engine's parameters: partitioned, they keep their own class."""
    for zp in engine.zero_model.params:
        zp.guarded_class = zp.plain_class
        zp.param.__class__ = zp.plain_class


def guard_swap_seconds(engine, n=200_000):
    """What the guard adds to one gather and release, at most: its two class assignments (best of 5)."""
    zp = engine.zero_model.params[0]
    p, plain, guarded = zp.param, zp.plain_class, zp.guarded_class
    keep, best = type(p), float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            p.__class__ = plain
            p.__class__ = guarded
        best = min(best, (time.perf_counter() - t0) / n)
    p.__class__ = keep
    return best


def timed(step, steps, warmup=3):
    """Best wall-clock and best CPU time (this process, all threads) of one step, in seconds."""
    for _ in range(warmup):
        step()
    best, best_cpu = float("inf"), float("inf")
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
    return best, best_cpu


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(8, 16)
    m = model(a.modules)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def plain():
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    steps = {"plain PyTorch": plain}
    zero_ext.init_distributed(verbose=False)
    fsdp = fsdp2_step(a.modules, x)
    if fsdp is not None:
        steps["FSDP2 (fully_shard per Linear)"] = fsdp
    engines = {}
    for label, check in (("stage 3", "1"), ("stage 3, no fetch-order check", "0"), ("stage 3, write guard off", "1")):
        os.environ["ZERO_EXT_CHECK_FETCH_ORDER"] = check
        cfg = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        engine = engines[label] = zero_ext.initialize(model=model(a.modules), config=cfg)[0]
        if "guard off" in label:
            unguard(engine)

        def z3(engine=engine):
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        steps[label] = z3
    # in turns, a few steps each per round, best per config: on a shared machine all see the same load
    best = {label: (float("inf"), float("inf")) for label in steps}
    for _ in range(max(1, a.steps // 2)):
        for label, step in steps.items():
            w, c = timed(step, 2, warmup=1)
            best[label] = (min(w, best[label][0]), min(c, best[label][1]))
    rows = list(best.items())
    base = best["plain PyTorch"]
    agreements, gathers = {}, {}
    for label, engine in engines.items():
        before, gathered = fetch.agreements(), engine.zero_model.meter.gathers
        steps[label]()  # one more step, to count its agreements (the first, recording step has one per fetch)
        agreements[label] = fetch.agreements() - before
        gathers[label] = engine.zero_model.meter.gathers - gathered
        stats = engine.zero_model.coordinator.stats
        if label == "stage 3":
            swap = guard_swap_seconds(engine)
        engine.destroy()
    modules = 2 * a.modules  # a Linear and a Tanh per layer; only the Linear has parameters
    print(f"{a.modules} Linear(16,16)+Tanh layers, 1 rank, configs in turns, best of {a.steps} steps each")
    fsdp = dict(rows).get("FSDP2 (fully_shard per Linear)")
    fsdp_extra = [(f - b) / modules * 1e6 for f, b in zip(fsdp, base)] if fsdp is not None else None
    print("us/module: microseconds per module per step above plain PyTorch; wall-clock, and CPU time of the "
          "process (less sensitive to other load on a shared machine)")
    print(f"{'config':34} {'step ms':>9} {'us/module':>10} {'x FSDP2':>8} {'CPU step ms':>12} {'CPU us/module':>14} "
          f"{'x FSDP2':>8}")
    for label, t in rows:
        cells = []
        for k in (0, 1):
            extra = (t[k] - base[k]) / modules * 1e6
            ratio = f"{extra / fsdp_extra[k]:8.2f}" if fsdp_extra and fsdp_extra[k] > 0 else f"{'-':>8}"
            cells.append((t[k] * 1e3, extra, ratio))
        (w, we, wr), (c, ce, cr) = cells
        print(f"{label:34} {w:9.2f} {we:10.1f} {wr} {c:12.2f} {ce:14.1f} {cr}")
    print("fetch-order agreements per step: " + ", ".join(f"{k}: {v}" for k, v in agreements.items()))
    print(f"prefetch counters of the last engine: {stats}")
    per_step = swap * gathers["stage 3"]
    print(f"write guard alone, at most: {swap * 1e9:.0f} ns per gather and release (its two class assignments), "
          f"{gathers['stage 3']} gathers per step: {per_step * 1e6:.1f} us per step, "
          f"{100 * per_step / best['stage 3'][0]:.2f}% of the stage 3 step")


if __name__ == "__main__":
    main()
