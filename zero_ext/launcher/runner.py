"""``zero-ext`` / ``python -m zero_ext.launcher``: DeepSpeed's one-node launcher, over plain processes.

    zero-ext --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json
    zero-ext estimate --params 7e9 --num_gpus 8        (memory tables; see estimate.py)

Starts N copies of the script with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and, as DeepSpeed's launcher does, ``--local_rank=<i>`` appended to each one's arguments.
When one exits with an error the others are stopped, so a failed rank never leaves the rest hanging.
Several nodes: use torchrun (``torchrun --nnodes M --nproc_per_node N --rdzv_endpoint HOST:PORT ...``).
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import List


def parse(argv: List[str]):
    p = argparse.ArgumentParser(prog="zero-ext", description=__doc__.split("\n\n")[0])
    p.add_argument("--num_gpus", "--num_procs", "--nproc_per_node", dest="num_procs", type=int, default=None,
                   help="processes to start (default: the CUDA devices, or 1 without CUDA)")
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=None, help="default: a free port")
    p.add_argument("--no_local_rank", action="store_true", help="do not append --local_rank to the script's arguments")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_procs() -> int:
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except ImportError:
        return 1


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["estimate"] and not os.path.exists("estimate"):  # a script named ./estimate still runs
        from .estimate import main as estimate_main

        return estimate_main(argv[1:])
    args = parse(argv)
    n = args.num_procs or _default_procs()
    port = args.master_port or _free_port()
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
               "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(port)}
        extra = [] if args.no_local_rank else [f"--local_rank={rank}"]
        procs.append(subprocess.Popen([sys.executable, "-u", args.script, *args.script_args, *extra], env=env))
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    for other in procs:  # a failed rank must not leave the others waiting in a collective
                        other.send_signal(signal.SIGTERM)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        code = 130
    return code

