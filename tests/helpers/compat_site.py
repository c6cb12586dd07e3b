"""Installs the compatibility package (compat/) with pip into a folder, for tests."""
import os
import shutil
import subprocess
import sys

from helpers import ROOT



def install_compat(base, python=sys.executable, allow_overwrite=True, check=True):
    """pip-installs a copy of compat/ (the checkout stays clean) into ``base/site``; returns the folder, or
    the CompletedProcess when ``check`` is False. ``allow_overwrite`` lifts the build's refusal to go over
    a real DeepSpeed (nothing is replaced in a folder of the test's own)."""
    src = os.path.join(base, "src")
    shutil.copytree(os.path.join(ROOT, "compat"), src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = os.path.join(base, "site")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("ZERO_EXT_ALLOW_DEEPSPEED_OVERWRITE", None)
    if allow_overwrite:
        env["ZERO_EXT_ALLOW_DEEPSPEED_OVERWRITE"] = "1"
    done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                           "--target", target, src], env=env, capture_output=True, text=True)
    if not check:
        return done
    if done.returncode:
        raise RuntimeError(f"installing compat/ failed:\n{done.stdout}\n{done.stderr}")
    return target
