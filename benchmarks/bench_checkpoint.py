"""Checkpoint save and load time: zero_ext against DeepSpeed on the same ZeRO-3 run, CPU, 2 ranks.

    python benchmarks/bench_checkpoint.py [--ds-python /tmp/dsvenv/bin/python] [--rounds 5]

The model is demo/model.py's GPT at ~19M parameters (d 512, 6 layers, byte vocabulary), fp32, ZeRO-3,
torch.optim.AdamW given as the client optimizer (the same on both sides: DeepSpeed's config AdamW is
FusedAdam, CUDA only), one training step before saving so the Adam state exists. Each side runs in its
own pair of fresh processes (gloo; DeepSpeed with DS_ACCELERATOR=cpu), in its own Python: DeepSpeed's
from ``--ds-python`` (a venv where the real DeepSpeed is installed; zero_ext's own compatibility
package, also named ``deepspeed``, is refused by name). A save is timed from a barrier to the end of
``save_checkpoint`` on the slower rank, a load likewise; zero_ext runs in its background-publish mode
(``ZERO_EXT_CHECKPOINT_PUBLISH=background``: the save returns once its files are written and
checksummed and publishes the tag once they are durable), so "save" is that mode's call and the
"published" column the save plus ``engine.wait_for_checkpoint()``: what the default (synchronous)
save costs (DeepSpeed's is its save: it never makes the files durable). The table shows the best and the median of
``--blocks`` x ``--rounds`` (each round saves to a new tag, then loads it; each block is a fresh pair
of processes, the two sides taking turns so that a busy spell of the machine hits both), and the
ratio zero_ext / DeepSpeed of each (below 1: zero_ext is faster). Both write to the same file system (``--dir``); the load reads
files the save has just written (the page cache holds them, for both alike).

What each writes: zero_ext a manifest with each file's CRC-32C (computed while writing), one fsync per
file and per folder, the tag folder put in place atomically, in the background (docs/checkpoints.md);
DeepSpeed its files with torch.save and no fsync.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
# the save and the publish timed apart (the default, sync, is their sum: the "published" column)
os.environ.setdefault("ZERO_EXT_CHECKPOINT_PUBLISH", "background")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-python", default="/tmp/dsvenv/bin/python",
                   help="a Python whose `import deepspeed` is the real DeepSpeed ('' to skip it)")
    p.add_argument("--rounds", type=int, default=5, help="save + load rounds per block")
    p.add_argument("--blocks", type=int, default=3, help="fresh process pairs per side, the sides taking turns")
    p.add_argument("--verbose", action="store_true", help="print every round's times")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "zero_ext" or "deepspeed": one rank
    p.add_argument("--port", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


# -- one rank (run as `--worker SIDE` with RANK / WORLD_SIZE set) ------------------------------------------

def _import_side(side):
    if side == "zero_ext":
        sys.path.insert(0, ROOT)  # this checkout's zero_ext
        import zero_ext
        return zero_ext
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed
    if "zeroext" in getattr(deepspeed, "__version__", "") or "compat" in os.path.dirname(deepspeed.__file__):
        raise SystemExit(f"the `deepspeed` imported ({deepspeed.__file__}, {deepspeed.__version__}) is zero_ext's "
                         "compatibility package, not DeepSpeed: pass --ds-python of a venv with DeepSpeed")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return deepspeed


def worker(side, rounds, folder):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    lib = _import_side(side)
    lib.init_distributed(dist_backend="gloo") if side == "deepspeed" else lib.init_distributed(
        dist_backend="gloo", verbose=False)
    sys.path.insert(0, ROOT)
    from demo.model import GPT, lm_loss

    torch.manual_seed(0)
    model = GPT(256, d=512, heads=8, layers=6, block=128)
    params = sum(p.numel() for p in model.parameters())  # (before stage 3 partitions them)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True, "wall_clock_breakdown": False}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = lib.initialize(model=model, optimizer=opt, config=config)[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, 128), generator=gen)
    loss = lm_loss(engine(x), x)
    engine.backward(loss)
    engine.step()
    saves, published, loads = [], [], []
    for k in range(rounds):
        dist.barrier()
        t = time.perf_counter()
        engine.save_checkpoint(folder, tag=f"r{k}")
        dist.barrier()
        saves.append(time.perf_counter() - t)
        if hasattr(engine, "wait_for_checkpoint"):  # zero_ext: durable and in place
            engine.wait_for_checkpoint()
            dist.barrier()
        published.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.load_checkpoint(folder, tag=f"r{k}")
        dist.barrier()
        loads.append(time.perf_counter() - t)
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(folder, f"r{k}"), ignore_errors=True)  # keep the page cache's share even
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"save": saves, "published": published, "load": loads, "params": params}),
              flush=True)
    dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------------------

def run_side(side, python, rounds, base, timeout):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix=f"ckpt-{side}-", dir=base)
    procs = []
    for r in range(WORLD):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(WORLD),
               "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        if side == "deepspeed":
            env["DS_ACCELERATOR"] = "cpu"
            env.pop("PYTHONPATH", None)  # nothing of this checkout (zero_ext's `deepspeed` package) on its path
        procs.append(subprocess.Popen([python, os.path.abspath(__file__), "--worker", side, "--rounds", str(rounds),
                                       "--dir", folder], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    shutil.rmtree(folder, ignore_errors=True)
    for line in outs[0][0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), None
    return None, (outs[0][1] or outs[0][0]).strip().splitlines()[-5:]


def main():
    args = parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.dir)
        return
    base = args.dir or tempfile.gettempdir()
    sides = {"zero_ext": sys.executable}
    if args.ds_python:
        sides["deepspeed"] = args.ds_python
    kinds = ("save", "published", "load")
    results = {side: ({k: [] for k in kinds}, None) for side in sides}
    for block in range(args.blocks):  # the sides take turns, so a busy spell of the machine hits both alike
        for side, python in sides.items():
            if results[side][0] is None:
                continue
            if not os.path.exists(python):
                results[side] = (None, [f"{python} does not exist"])
                continue
            res, why = run_side(side, python, args.rounds, base, args.timeout)
            if res is None:
                results[side] = (None, why)
                continue
            for k in kinds:
                results[side][0][k].extend(res[k])
            results[side][0]["params"] = res["params"]
            if args.verbose:
                print(f"block {block} {side}: " + " ".join(f"{k} {[round(x, 3) for x in res[k]]}" for k in kinds),
                      flush=True)
    ours = results["zero_ext"][0]
    print(f"ZeRO-3, {ours['params'] / 1e6:.1f}M parameters, {WORLD} ranks, CPU gloo, {args.blocks} x {args.rounds} rounds; "
          f"seconds (best / median); x = zero_ext / DeepSpeed; load average {os.getloadavg()[1]:.1f} (5 min)")
    print("| | save best | save median | published best | published median | load best | load median |")
    print("|---|---|---|---|---|---|---|")
    for side, (res, why) in results.items():
        if res is None:
            print(f"| {side} | not measured: {' / '.join(why)} | | | | | |")
            continue
        print(f"| {side} | " + " | ".join(f"{min(res[k]):.3f} | {statistics.median(res[k]):.3f}" for k in kinds) + " |")
    ds = results.get("deepspeed", (None, None))[0]
    if ds is not None:
        print("| x | " + " | ".join(f"{min(ours[k]) / min(ds[k]):.2f} | "
                                    f"{statistics.median(ours[k]) / statistics.median(ds[k]):.2f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
