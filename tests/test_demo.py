"""`make demo`'s script for 3 steps: torchrun starts 2 gloo ranks, it exits 0 and prints the memory table."""
import os
import subprocess
import sys

import pytest

from helpers import ROOT

# a launcher's variables in this process would steer torchrun's children to the wrong group
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID")


def _run_demo(*extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    # this checkout's zero_ext, whichever copy is pip-installed
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT] + env.get("PYTHONPATH", "").split(os.pathsep)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "demo", "train_gpt.py"), "--steps", "3", "--sample-chars", "20", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_demo_saves_a_checkpoint_and_resumes_from_it(tmp_path):
    first = _run_demo("--checkpoint", str(tmp_path))
    assert first.returncode == 0, first.stderr[-4000:]
    assert "checkpoint saved in" in first.stdout and "at step 3" in first.stdout
    second = _run_demo("--checkpoint", str(tmp_path))
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stdout and "at step 6" in second.stdout


@pytest.mark.slow
def test_demo_trains_and_prints_memory_table():
    proc = _run_demo()
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    assert any(line.startswith("step    3  loss") for line in lines), proc.stdout
    header = [line.split() for line in lines if line.startswith("kind")]
    assert header == [["kind", "rank0", "rank1", "unsharded"]], proc.stdout
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split() and line.split()[0] in
            ("params", "optimizer_state", "total")}
    assert set(rows) == {"params", "optimizer_state", "total"}, proc.stdout
    rank0, rank1, unsharded = (float(x) for x in rows["total"])
    assert 0 < rank0 <= unsharded and 0 < rank1 <= unsharded, proc.stdout
    assert "sample (temperature" in proc.stdout
