"""Shared test set-up: one torch thread per process, the multi-rank pools closed at the end, and the
fixtures every test file may ask for by name: `mounts` (helpers/fs.py), `two_threads` (helpers/cpu_optim.py)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import helpers` (tests/helpers/)

from helpers import harness  # noqa: E402
from helpers.cpu_optim import two_threads  # noqa: E402,F401 - fixtures, used by name
from helpers.fs import mounts  # noqa: E402,F401

torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus):
    harness.close_pools()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run benchmarks/gpu_suite.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
