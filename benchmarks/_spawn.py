"""What the multi-process benchmarks share: start `world` spawned ranks on a free port and collect what
they put on a queue, killing them all at a deadline (benchmarks decide nothing, but must not hang)."""
import socket
import time

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, worker_args: tuple, world: int, timeout: float, label: str, results: int = 1) -> list:
    """Runs worker(rank, *worker_args, port, queue) on `world` spawned processes; returns the first
    `results` items they put on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(worker, args=(*worker_args, free_port(), queue), nprocs=world, join=False,
                               start_method="spawn")
    deadline = time.monotonic() + timeout
    while not procs.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            raise TimeoutError(f"{label}: no result within {timeout:.0f} s")
    return [queue.get() for _ in range(results)]
