"""On torch.distributed, a rank whose script ends by an exception says so in the store as it exits
(comm/departures.py): the survivor's failed collective is a CommError naming the rank and the
exception, not only gloo's "Connection closed by peer"."""
import os
import subprocess
import sys
import textwrap

from helpers import ROOT
from helpers.harness import free_port

SCRIPT = textwrap.dedent("""
    import time, torch, zero_ext
    from zero_ext import comm
    zero_ext.init_distributed(dist_backend="gloo", verbose=False)
    comm.barrier()
    if comm.get_rank() == 1:
        raise ValueError("a bad batch on rank 1")
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
        print("ok")
    except Exception as exc:
        print(f"{time.monotonic() - start:.1f} {type(exc).__name__}: {exc}")
""")


def test_a_rank_that_exits_by_an_exception_is_named_by_the_survivor_on_torch_distributed(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    procs = []
    for r in range(2):
        env = {**os.environ, "ZERO_EXT_COMM": "torch", "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    survivor, leaver = (p.communicate(timeout=120) for p in procs)
    assert procs[1].returncode == 1 and "ValueError: a bad batch on rank 1" in leaver[1]
    seconds, message = survivor[0].strip().split(" ", 1)
    assert float(seconds) < 20, message  # generous (2 loaded cores): gloo notices the closed socket at once
    assert message.startswith("CommError: zero_ext collective all_reduce failed: rank 1 left: its process exited "
                              "after ValueError: a bad batch on rank 1 (torch.distributed said:"), message
