"""Runs a function on N ranks (spawned processes, gloo on a free localhost port) and returns each result.

    results = run_ranks(2, fn, arg, timeout=60)   # fn(arg) on ranks 0 and 1, a list of two results

Starting a process costs seconds (importing torch), so each world size keeps a pool of workers that run
case after case; the workers fork from a server that has torch imported already. For each case every
worker sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), initialises a
gloo process group (unless init=False), runs fn with one torch thread, and destroys the group again.

When a rank fails, its traceback is raised here (RankFailed) and the ranks still running, stuck in a
collective that will never complete, are killed at once; when the deadline passes, every unfinished
rank is killed (RankTimeout). Killed workers are replaced on the next call. `fn` and its arguments and
results must be picklable: define fn at module level in a test file.
"""
import atexit
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List

# After the first failure, how long the other ranks get to report their own (often the root cause).
GRACE_SECONDS = 1.0
DEFAULT_TIMEOUT = 120.0


class RankFailed(RuntimeError):
    """A rank raised (or died); the message holds its traceback."""


class RankTimeout(TimeoutError):
    """Some ranks did not finish before the deadline; they were killed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, conn) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        fn, args, kwargs, env, init, timeout = job
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            if init:
                import zero_ext

                zero_ext.init_distributed(dist_backend="gloo", verbose=False,
                                          timeout=__import__("datetime").timedelta(seconds=timeout))
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the test
            reply = ("error", f"{type(exc).__name__}: {exc}\n" + traceback.format_exc())
        publisher = sys.modules.get("zero_ext.checkpoint.publish")
        if publisher is not None:  # a save still being published ends with the case, as at a script's exit
            unpublished = publisher.settle()
            if unpublished is not None and reply[0] == "ok":
                reply = ("error", f"CheckpointPublishError: {unpublished}")
        try:  # report before tearing the group down: peers then fail second, and the cause comes first
            conn.send(reply)
        except Exception as exc:  # an unpicklable result: say so rather than hang the test
            conn.send(("error", f"result of rank {rank} could not be sent back: {exc!r}"))
        if dist.is_initialized():
            from zero_ext import comm

            comm.destroy_process_group()  # the native communicators go now, not when gc finds the group
        for k, v in saved.items():  # a case's env (e.g. ZERO_EXT_COMM) is not the next case's
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class WorkerPool:
    """A fixed set of `world_size` worker processes that run one case at a time."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "torch.distributed", "zero_ext"])
        self.workers: List[Any] = [None] * world_size  # (process, connection) per rank

    def _ensure(self, rank: int) -> None:
        w = self.workers[rank]
        if w is not None and w[0].is_alive():
            return
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker_main, args=(rank, self.world_size, child), daemon=True,
                                name=f"zero_ext-test-rank{rank}of{self.world_size}")
        proc.start()
        child.close()
        self.workers[rank] = (proc, parent)

    def _kill(self, rank: int) -> None:
        proc, conn = self.workers[rank]
        proc.kill()
        proc.join(5)
        conn.close()
        self.workers[rank] = None

    def run(self, fn: Callable, args=(), kwargs=None, timeout: float = DEFAULT_TIMEOUT, init: bool = True,
            env: Dict[str, str] = None) -> List[Any]:
        for r in range(self.world_size):
            self._ensure(r)
        port = str(free_port())
        for r, (_, conn) in enumerate(self.workers):
            rank_env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(self.world_size),
                        "LOCAL_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port, **(env or {})}
            conn.send((fn, tuple(args), dict(kwargs or {}), rank_env, init, timeout))
        return self._collect(timeout)

    def _collect(self, timeout: float) -> List[Any]:
        deadline = time.monotonic() + timeout
        pending = {conn: r for r, (_, conn) in enumerate(self.workers)}
        results: List[Any] = [None] * self.world_size
        errors: Dict[int, str] = {}  # in the order they arrived: the first is usually the cause
        while pending:
            left = deadline - time.monotonic()
            if errors:
                left = min(left, first_error_at + GRACE_SECONDS - time.monotonic())
            if left <= 0:
                break
            for conn in wait(list(pending), timeout=left):
                r = pending.pop(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    proc = self.workers[r][0]
                    proc.join(1)
                    status, value = "error", f"rank {r} died (exit code {proc.exitcode})"
                if status == "ok":
                    results[r] = value
                else:
                    if not errors:
                        first_error_at = time.monotonic()
                    errors[r] = value
        for r in pending.values():
            self._kill(r)
        if errors:
            # a rank that died is the cause even when a survivor's error (fast native collectives
            # notice a death within milliseconds) arrived in the same wait
            first = next((r for r, e in errors.items() if e.startswith(f"rank {r} died")), next(iter(errors)))
            others = sorted(set(errors) - {first})
            note = f" (ranks {others} failed too)" if others else ""
            killed = f"; ranks {sorted(pending.values())} were killed" if pending else ""
            raise RankFailed(f"rank {first} of {self.world_size} failed{note}{killed}:\n{errors[first]}")
        if pending:
            raise RankTimeout(f"ranks {sorted(pending.values())} of {self.world_size} did not finish within "
                              f"{timeout:.0f}s and were killed")
        return results

    def close(self) -> None:
        for r, w in enumerate(self.workers):
            if w is None:
                continue
            try:
                w[1].send(None)
            except OSError:
                pass
            w[0].join(2)
            if w[0].is_alive():
                self._kill(r)


_POOLS: Dict[int, WorkerPool] = {}


def run_ranks(world_size: int, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT, init: bool = True,
              env: Dict[str, str] = None, **kwargs) -> List[Any]:
    """fn(*args, **kwargs) on `world_size` ranks; the list of their results, rank by rank."""
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool.run(fn, args, kwargs, timeout=timeout, init=init, env=env)


def restart_pool(world_size: int) -> None:
    """The next run_ranks(world_size, ...) starts fresh processes (e.g. to resume from a checkpoint)."""
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close()


@atexit.register
def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
