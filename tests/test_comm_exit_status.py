"""A 2-rank zero_ext script exits with its own status however it ends (docs/debugging.md, "A rank killed
by SIGABRT at exit"): without engine.destroy(), with or without destroy_process_group(), by
sys.exit() or an exception mid-step, forward-only — run as real jobs whose interpreters finalize,
beside busy processes. The short version of tests/stress/exit_aborts.py, which runs each ending at
each stage 200 times in fresh interpreters (outside the suite: about an hour); here the ranks fork
from a zygote to stay within seconds, which checks every ending's status and hook but seldom meets
the race itself (test_comm_exit_tracking.py checks its cause, call by call)."""
import pytest

from helpers.exit_runs import ENDINGS, EXIT_SCRIPT, Ranks, busy

# every ending once but destroy (test_comm_exit_tracking.py), at stages 1-3
JOBS = [("plain", 2), ("bare", 3), ("exit", 2), ("raise", 1), ("forward", 3)]


@pytest.fixture(scope="module")
def ranks():
    with Ranks(2) as r:
        yield r


def test_the_harness_sees_a_rank_killed_by_sigabrt(ranks, tmp_path):
    script = tmp_path / "abort.py"
    script.write_text("import os, sys\nif sys.argv[1] == '1': os.abort()\n")
    job = ranks.run(str(script), ["1"])
    assert job.aborted() and job.codes == [-6, -6]
    assert ranks.run(str(script), ["0"]).codes == [0, 0]


def test_every_ending_exits_with_the_scripts_own_status_under_load(ranks):
    wrong = []
    with busy(2):
        for ending, stage in JOBS:
            job = ranks.run(EXIT_SCRIPT, [ending, str(stage)])
            if job.codes != [ENDINGS[ending]] * 2:
                wrong.append(f"{ending} at stage {stage}: exit codes {job.codes}, want {ENDINGS[ending]}\n"
                             + "\n".join(err[-800:] for err in job.stderr))
            elif ending == "raise":
                assert all("the user's script failed mid-step" in err for err in job.stderr)
            else:
                assert not any("terminate called" in err or "Traceback" in err for err in job.stderr), job.stderr
    assert not wrong, "\n".join(wrong)
