"""The compatibility package (compat/) for tests: imported from the checkout, or installed with pip into a
folder."""
import os
import shutil
import subprocess
import sys

from helpers import ROOT

COMPAT = os.path.join(ROOT, "compat")


def import_checkout_compat():
    """The checkout's `deepspeed` package, imported in this process (an installed copy of another
    checkout, already imported, is set aside)."""
    if COMPAT not in sys.path:
        sys.path.insert(0, COMPAT)
    mod = sys.modules.get("deepspeed")
    if mod is not None and not os.path.realpath(mod.__file__).startswith(os.path.realpath(COMPAT)):
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]
    import deepspeed

    return deepspeed


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
