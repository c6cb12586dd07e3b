"""Helpers shared by the test files (no tests here); conftest.py puts tests/ on sys.path, so a test
file imports them as ``from helpers.harness import run_ranks`` or ``from helpers import ROOT``.

Files:
- harness.py: ``run_ranks(n, fn, ...)``, a function on N gloo ranks through pooled worker processes.
- exit_runs.py: real 2-rank jobs that run a script and exit (``Ranks``), and ``busy(n)`` CPU load;
  exit_script.py (a zero_ext user's script, ending in one of several ways), exit_script_torch.py (its
  torch-only twin), exit_zygote.py (forks ranks with torch imported).
- models.py: the small engine-test models (MLP, TinyGPT) and ``MODELS`` by name.
- zero3.py: ZeRO-3 parameter-layer helpers (rank, full_values, grads, same_tensors), models, and a tiny HF
  Llama with greedy `generate` for the generation tests.
- planner_ref.py: a pure-Python reference of the C planner (csrc/planner.c).
- engine.py: what engine tests read back from a trained engine (full parameters, fp32 masters).
- cpu_optim.py: the ISA list and the two-thread fixture of the C CPU optimizer tests.
- fs.py: a forked child (``in_child``), a file system of the test's own (``mount``) and ``mounts``.
- compat_site.py: pip-installs the ``deepspeed`` compatibility package (compat/) into a folder.
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
