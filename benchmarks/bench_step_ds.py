"""The real DeepSpeed's step on bench_step.py's model and config, for its DeepSpeed column. Run by
bench_step.py with the Python of a venv where DeepSpeed is installed (``--ds-python``), never with
zero_ext's ``deepspeed`` compatibility package, which it refuses by name:

    <venv>/bin/python benchmarks/bench_step_ds.py --name z3 --config '<json>' --steps 8 --warmup 2 ...

DeepSpeed runs on CPU (DS_ACCELERATOR=cpu) over gloo (``init_distributed(dist_backend="gloo")``), 2
spawned ranks, one torch thread each, the same GPT, batches and timing as bench_step.py's worker (a
step starts at a barrier; the slower rank's time counts). Prints one JSON line: the per-step times.
Imports neither zero_ext nor bench_step (whose module imports zero_ext).
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/dsext")  # DeepSpeed's JIT-built ops, built once

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # the demo's model (after site-packages: this checkout's `deepspeed` must not shadow)

from _spawn import spawn_ranks  # noqa: E402

WORLD = 2


def real_deepspeed():
    """The deepspeed module, or SystemExit naming why it is not DeepSpeed itself."""
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    where = os.path.realpath(deepspeed.__file__)
    if "zeroext" in getattr(deepspeed, "__version__", "") or os.sep + "compat" + os.sep in where:
        raise SystemExit(f"bench_step_ds: `deepspeed` here is zero_ext's compatibility package ({where}), not "
                         "DeepSpeed: run this with the Python of a venv where DeepSpeed is installed")
    return deepspeed


def worker(rank: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    deepspeed = real_deepspeed()
    from demo.model import GPT, count_params, lm_loss

    deepspeed.init_distributed(dist_backend="gloo")
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.manual_seed(0)
    model = GPT(256, d=512, heads=8, layers=6, block=args.block)
    params = count_params(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=json.loads(args.config))
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    clock = {"t": 0.0, "t0": 0.0}
    base.register_step_pre_hook(lambda *a: clock.__setitem__("t0", time.perf_counter()))
    base.register_step_post_hook(lambda *a: clock.__setitem__("t", clock["t"] + time.perf_counter() - clock["t0"]))
    gen = torch.Generator().manual_seed(100 + rank)  # bench_step.py's batches
    times, opt_times, updates, cpus = [], [], [], []
    for _ in range(args.warmup + args.steps):
        x = torch.randint(0, 256, (args.batch, args.block + 1), generator=gen)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        engine.backward(lm_loss(engine(x[:, :-1]), x[:, 1:]))
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        times.append(t2 - t0)
        cpus.append(time.process_time() - c0)
        opt_times.append(t2 - t1)
        updates.append(clock["t"])
        clock["t"] = 0.0
    timed = torch.tensor([times[args.warmup:], opt_times[args.warmup:], updates[args.warmup:], cpus[args.warmup:]],
                         dtype=torch.float64)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)
    queue.put({"rank": rank, "times": timed[0].tolist(), "opt_times": timed[1].tolist(), "updates": timed[2].tolist(),
               "cpus": timed[3].tolist(),
               "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "baseline": baseline,
               "optimizer": f"DS {type(base).__name__}", "params": params, "version": deepspeed.__version__})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--config", required=True, help="the DeepSpeed config, JSON")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    real_deepspeed()  # refuse before spawning anything
    results = sorted(spawn_ranks(worker, (args,), WORLD, args.timeout, "ds-" + args.name, results=WORLD),
                     key=lambda r: r["rank"])
    r0 = results[0]
    print(json.dumps({"step": statistics.median(r0["times"]), "best": min(r0["times"]),
                      "opt": statistics.median(r0["opt_times"]), "opt_best": min(r0["opt_times"]),
                      "update": statistics.median(r0["updates"]), "update_best": min(r0["updates"]),
                      "cpu": statistics.median(r0["cpus"]),
                      "optimizer": r0["optimizer"], "rss": [r["rss"] for r in results],
                      "baseline": [r["baseline"] for r in results], "tensors": [float("nan")] * WORLD,
                      "params": r0["params"], "agreements": 0.0, "version": r0["version"]}))


if __name__ == "__main__":
    main()
