"""Real 2-rank jobs that end as a script ends: each rank runs ``SCRIPT ARGS`` as ``__main__`` with
torchrun's variables and then finalizes its interpreter (atexit hooks, Py_FinalizeEx), which the
pooled workers of harness.py never reach. ``busy(n)`` keeps n CPU-bound processes beside them: the
exit race of docs/debugging.md ("A rank killed by SIGABRT at exit") needs a rank descheduled at the
wrong moment.

Two ways to start a rank:
- fresh (``Ranks(2, fresh=True)``): ``python SCRIPT`` in a session of its own, as torchrun starts it.
  This is what reproduces the race (torch alone: 9 of 20 torchrun jobs of a tight all_reduce loop; a
  rank forked from a zygote, or started without a session of its own, hardly ever races), at the cost
  of importing torch twice per job.
- forked from a zygote (exit_zygote.py) that has torch imported: a second per job, for checking how
  every ending exits (the short suite), not for counting the race.

    with Ranks(2, fresh=True) as ranks, busy(2):
        job = ranks.run(EXIT_SCRIPT, ["plain", "2"])   # job.codes == [0, 0]; -6 is a SIGABRT
"""
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Sequence

from . import ROOT
from .harness import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
EXIT_SCRIPT = os.path.join(HERE, "exit_script.py")
TORCH_SCRIPT = os.path.join(HERE, "exit_script_torch.py")
ENDINGS = {"plain": 0, "destroy": 0, "bare": 0, "exit": 7, "raise": 1, "forward": 0}  # -> the script's status


@dataclass
class Job:
    codes: List[int]  # each rank's exit code (negative: killed by that signal; -9 at the deadline)
    stderr: List[str]

    def aborted(self) -> bool:
        return -signal.SIGABRT in self.codes


class Ranks:
    """``world`` ranks; ``run`` starts a job on all of them at once (see the module's docstring)."""

    def __init__(self, world: int = 2, fresh: bool = False):
        self.world, self.fresh = world, fresh
        self.env = dict(os.environ, OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        self.zygotes = [] if fresh else [
            subprocess.Popen([sys.executable, os.path.join(HERE, "exit_zygote.py")], env=self.env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(world)]
        self.tmp = tempfile.TemporaryDirectory(prefix="zero_ext-exit-")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for z in self.zygotes:
            z.stdin.close()
            z.wait(30)
        self.tmp.cleanup()

    def run(self, script: str, args: Sequence[str], timeout: float = 120.0) -> Job:
        """Runs ``script`` on every rank (gloo on a free localhost port); ranks still running at the
        deadline are killed."""
        port = str(free_port())
        logs = [os.path.join(self.tmp.name, f"rank{rank}.err") for rank in range(self.world)]
        envs = [{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world),
                 "LOCAL_WORLD_SIZE": str(self.world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
                for rank in range(self.world)]
        start = self._fresh if self.fresh else self._forked
        codes = start(script, list(args), envs, logs, time.monotonic() + timeout)
        return Job(codes, [open(log).read() for log in logs])

    def _fresh(self, script, args, envs, logs, deadline) -> List[int]:
        procs = []
        for env, log in zip(envs, logs):
            with open(log, "w") as err:
                procs.append(subprocess.Popen([sys.executable, script, *args], env={**self.env, **env},
                                              stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                p.wait()
        return [p.returncode for p in procs]

    def _forked(self, script, args, envs, logs, deadline) -> List[int]:
        pids = []
        for z, env, log in zip(self.zygotes, envs, logs):
            z.stdin.write(json.dumps({"script": script, "args": args, "env": env, "stderr": log}) + "\n")
            z.stdin.flush()
            pids.append(json.loads(z.stdout.readline())["pid"])
        codes = []
        for z in self.zygotes:
            if not select.select([z.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            codes.append(json.loads(z.stdout.readline())["code"])
        return codes


@contextlib.contextmanager
def busy(n: int):
    """n processes spinning on a CPU each, for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
