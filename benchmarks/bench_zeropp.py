"""ZeRO++ on 4 CPU ranks as 2 "nodes" of 2: bytes crossing the node boundary per step and step time, for
plain ZeRO-3, qwZ, qgZ, hpZ, all three and MiCS (flat and two-level), in the same run.

    python benchmarks/bench_zeropp.py [--steps 6] [--warmup 2] [--rounds 3] [--verbose] [--layers 4] [--d 384]
    python benchmarks/bench_zeropp.py --profile 0 [--configs zero3,qwZ+qgZ+hpZ]   # where one rank's CPU goes

The model is demo/model.py's GPT (byte vocabulary), fp32, AdamW, each configuration in a fresh set of
spawned processes. Bytes are counted by the collective facade (zero_ext.comm.traffic: what each rank
must send to each other, and the part going to the other node), summed over ranks and divided by the
steps; the "by verb" column splits the cross-node bytes into all-gathers (parameters), reductions
(gradients: on CPU the plain stage-3 reduction is an all-reduce of which each rank keeps its block, which
moves twice a reduce-scatter's bytes; qgZ's is an all-to-all) and the rest. Ratios are against plain
ZeRO-3 measured in the same run. The ZeRO++ paper's headline is 4x less cross-node volume with all three.
Each rank sees LOCAL_WORLD_SIZE=2, so qgZ alone also runs in two levels (intra-node, then inter-node).
Step time is the median over the timed steps of the slower rank (from a barrier); CPU is the CPU time of
all four processes per step (their threads included: on a shared machine it moves less with the load
than wall time does). With --rounds R every configuration runs R times, the configurations taking turns;
the table gives medians over rounds, and the ratios are medians of each round's ratio.
With --profile R, rank R also runs cProfile over the timed steps with a CPU-time clock (its main thread:
waiting is not counted, page faults are) and the table is followed by, per configuration, that rank's CPU
per phase (forward / backward / step, process time), its page faults per step and the functions taking
the most of its CPU (to compare a ZeRO++ option with ZeRO-3 measured in the same run).
"""
import argparse
import cProfile
import io
import os
import pstats
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import zero_ext  # noqa: E402
from demo.model import GPT, count_params, lm_loss  # noqa: E402
from zero_ext.comm import traffic  # noqa: E402

from _spawn import spawn_ranks  # noqa: E402

WORLD, NODE = 4, 2
CONFIGS = {
    "zero3": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "hpZ": {"zero_hpz_partition_size": NODE},
    "qwZ+qgZ+hpZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                    "zero_hpz_partition_size": NODE},
}

# MiCS (zero/mics.py): "MiCS" shards each node's ranks (shard group = node: gathers stay inside it, each
# gradient piece is all-reduced with the other node's replica); "MiCS-2lvl" shards over all 4 ranks and
# gathers in two levels (across nodes among same-local-rank pairs, then inside the node). Nodes for MiCS's
# hierarchy come from NDEV_PER_NODE, set here for every spawned rank.
MICS = {
    "MiCS": {"mics_shard_size": NODE},
    "MiCS-2lvl": {"mics_shard_size": WORLD, "mics_hierarchical_params_gather": True},
}
CONFIGS.update(MICS)
os.environ.setdefault("NDEV_PER_NODE", str(NODE))


def worker(rank, name, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank % NODE), LOCAL_WORLD_SIZE=str(NODE))
    torch.set_num_threads(1)
    zero_ext.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT(256, d=args.d, heads=8, layers=args.layers, block=args.block)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              # prefetch one layer's worth: a whole-model bucket would keep everything gathered
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 4 * args.d * args.d,
                                    "stage3_max_reuse_distance": 0, **CONFIGS[name]}}
    engine, _, _, _ = zero_ext.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(rank)
    times, cpu, phases, faults = [], [], [], []
    profile = cProfile.Profile(time.thread_time) if rank == args.profile else None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            traffic.start(node_size=NODE)
        x = torch.randint(0, 256, (args.batch, args.block), generator=gen)
        dist.barrier()
        timed = profile is not None and step >= args.warmup
        if timed:
            profile.enable()
        start, start_cpu = time.perf_counter(), time.process_time()
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = lm_loss(engine(x[:, :-1]), x[:, 1:])
        forward = time.process_time()
        engine.backward(loss)
        backward = time.process_time()
        engine.step()
        if timed:
            profile.disable()
            phases.append((forward - start_cpu, backward - forward, time.process_time() - backward))
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
        elapsed = torch.tensor([time.perf_counter() - start])
        used = torch.tensor([time.process_time() - start_cpu])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # (torch.distributed itself: not counted)
        dist.all_reduce(used)
        if step >= args.warmup:
            times.append(elapsed.item())
            cpu.append(used.item())
    counted = traffic.snapshot()
    traffic.stop()
    rows = [None] * WORLD
    dist.all_gather_object(rows, counted)
    report = [None]
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        report[0] = {"phases": [statistics.median(p[k] for p in phases) for k in range(3)],
                     "faults": statistics.median(faults), "stats": text.getvalue()}
    dist.broadcast_object_list(report, src=max(args.profile, 0))
    if rank == 0:
        queue.put({"name": name, "params": count_params(model), "time": statistics.median(times),
                   "cpu": statistics.median(cpu), "rows": rows, "profile": report[0]})
    engine.destroy()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--block", type=int, default=65)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--verbose", action="store_true", help="print every round's step and CPU times")
    ap.add_argument("--profile", type=int, default=-1, metavar="RANK",
                    help="profile this rank's timed steps (cProfile, CPU-time clock); -1: none")
    ap.add_argument("--top", type=int, default=25, help="functions listed per configuration with --profile")
    args = ap.parse_args()
    names = args.configs.split(",")
    loads = [os.getloadavg()[0]]
    rounds = []
    for _ in range(args.rounds):
        rounds.append({name: spawn_ranks(worker, (name, args), WORLD, 1800, name)[0] for name in names})
        loads.append(os.getloadavg()[0])
    base_name = "zero3" if "zero3" in names else names[0]

    def cross(r):
        return sum(row["cross_node"] for row in r["rows"]) / args.steps

    def verbs(r):
        out = {}
        for row in r["rows"]:
            for verb, (_, c) in row["by_verb"].items():
                out[verb] = out.get(verb, 0) + c / args.steps
        return out

    def median(name, key, ratio=False):
        return statistics.median(rd[name][key] / (rd[base_name][key] if ratio else 1) for rd in rounds)
    first = rounds[0]
    base = first[base_name]
    load = " -> ".join(f"{x:.1f}" for x in loads)
    print(f"# {base['params'] / 1e6:.1f}M parameters, fp32, {WORLD} ranks as {WORLD // NODE} nodes of {NODE}; "
          f"{args.steps} steps after {args.warmup}; {args.rounds} round(s); load {load}")
    if args.verbose:
        for k, rd in enumerate(rounds):
            print(f"# round {k}: " + "  ".join(f"{name} {rd[name]['time']:.3f} s / {rd[name]['cpu']:.3f} CPU s"
                                               for name in names))
    print(f"{'config':13} {'cross-node MB/step':>18} {'vs zero3':>9} {'step s':>8} {'vs zero3':>9} {'CPU s':>7} "
          f"{'vs zero3':>9}  cross-node MB by verb")
    for name in names:
        r = first[name]
        by = " ".join(f"{v}={b / 1e6:.2f}" for v, b in sorted(verbs(r).items()) if b)
        print(f"{name:13} {cross(r) / 1e6:18.2f} {cross(base) / max(cross(r), 1):8.2f}x "
              f"{median(name, 'time'):8.3f} {median(name, 'time', True):8.2f}x {median(name, 'cpu'):7.3f} "
              f"{median(name, 'cpu', True):8.2f}x  {by}")
    if args.profile >= 0:
        for name in names:
            prof = rounds[-1][name]["profile"]
            fwd, bwd, opt = (1e3 * x for x in prof["phases"])
            print(f"\n## {name}, rank {args.profile}, last round: process CPU forward {fwd:.1f} / backward {bwd:.1f} / "
                  f"step {opt:.1f} ms, {prof['faults']:.0f} page faults per step; main thread's functions by own CPU "
                  f"over {args.steps} steps:")
            print("\n".join(line for line in prof["stats"].splitlines() if line.strip()))


if __name__ == "__main__":
    main()
