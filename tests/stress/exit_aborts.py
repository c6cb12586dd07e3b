"""Stress: how often does a 2-rank script die of a signal at exit? (docs/debugging.md, "A rank killed
by SIGABRT at exit"). Runs tests/helpers/exit_script.py (or its torch-only twin) many times, each
rank a fresh interpreter in a session of its own as torchrun starts it, beside ``--busy`` spinning
processes, cycling through endings and ZeRO stages; counts each rank's exit status against the
script's own. Exit status 1 if any run ended otherwise.

    python3 tests/stress/exit_aborts.py --runs 200              # zero_ext scripts, every ending
    python3 tests/stress/exit_aborts.py --runs 60 --torch-only  # torch + gloo alone, for comparison

Outside the default suite (200 runs take about an hour on 2 loaded cores);
tests/test_comm_exit_status.py runs a short version.
"""
import argparse
import collections
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers.exit_runs import ENDINGS, EXIT_SCRIPT, TORCH_SCRIPT, Ranks, busy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--busy", type=int, default=2, help="spinning processes beside the ranks")
    ap.add_argument("--endings", default=",".join(ENDINGS), help="comma-separated, of: " + ", ".join(ENDINGS))
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--torch-only", action="store_true", help="run the torch-only twin instead (endings plain, bare)")
    ap.add_argument("--zygote", action="store_true", help="fork the ranks from a zygote (fast, but hardly races)")
    opts = ap.parse_args()
    if opts.torch_only:
        endings = [e for e in opts.endings.split(",") if e in ("plain", "bare")] or ["bare"]
        cases = itertools.cycle([(TORCH_SCRIPT, (e,), f"torch-only {e}", 0) for e in endings])
    else:
        combos = [(e, s) for e in opts.endings.split(",") for s in opts.stages.split(",")]
        cases = itertools.cycle([(EXIT_SCRIPT, (e, s), f"{e} stage {s}", ENDINGS[e]) for e, s in combos])
    tally = collections.defaultdict(collections.Counter)
    bad = 0
    start = time.monotonic()
    with Ranks(2, fresh=not opts.zygote) as ranks, busy(opts.busy):
        for i, (script, args, label, want) in zip(range(opts.runs), cases):
            job = ranks.run(script, args)
            ok = job.codes == [want, want]
            tally[label]["runs"] += 1
            tally[label]["aborts"] += job.aborted()
            if not ok:
                bad += 1
                tally[label]["wrong"] += 1
                print(f"run {i}: {label}: exit codes {job.codes} (want {want})", flush=True)
                for rank, err in enumerate(job.stderr):
                    if job.codes[rank] != want:
                        print(f"  rank {rank} stderr tail:\n" + err[-1500:], flush=True)
            if (i + 1) % 20 == 0:
                print(f"{i + 1} runs, {bad} wrong, {time.monotonic() - start:.0f} s", flush=True)
    aborts = sum(t["aborts"] for t in tally.values())
    for label, t in sorted(tally.items()):
        print(f"{label:20s} runs {t['runs']:4d}  aborts {t['aborts']:3d}  wrong status {t['wrong']:3d}")
    print(f"total: {opts.runs} runs, {aborts} with a rank killed by SIGABRT, {bad} with a status not the "
          f"script's own ({time.monotonic() - start:.0f} s, {opts.busy} busy processes, "
          f"{'zygote' if opts.zygote else 'fresh interpreters'})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
