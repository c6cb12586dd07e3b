#!/usr/bin/env bash
# Idempotent set-up for a brand-new machine of ours: installs only what is missing (torch from PyPI,
# liburing from Debian, the Python test tools), then builds zero_ext in place (pip install -e).
# An installed torch >= 2.4 is reused, never downloaded again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

say() { printf 'setup: %s\n' "$*"; }

# torch: keep any torch >= 2.4 (GPU machines may carry an older one than PyPI's newest).
if ! "$PY" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 4))' 2>/dev/null; then
	say "installing torch from PyPI (several GB, once)"
	"$PY" -m pip install --quiet 'torch>=2.4'
fi

# The other Python packages, by import name = pip name, each only if it does not import.
missing=$("$PY" - <<'PYEOF'
import importlib.util
import importlib.metadata
need = {"pydantic": "pydantic>=2", "numpy": "numpy", "tqdm": "tqdm", "hjson": "hjson", "pytest": "pytest",
        "hypothesis": "hypothesis", "setuptools": "setuptools>=77", "wheel": "wheel"}
def too_old(dist, minimum):  # pyproject.toml's SPDX `license` string needs setuptools 77
    major = importlib.metadata.version(dist).split(".")[0]
    return not major.isdigit() or int(major) < minimum
print(" ".join(spec for mod, spec in need.items() if importlib.util.find_spec(mod) is None
               or (mod == "setuptools" and too_old("setuptools", 77))))
PYEOF
)
if [ -n "$missing" ]; then
	say "installing $missing"
	"$PY" -m pip install --quiet $missing
fi

# liburing (NVMe swapping through io_uring).
if [ ! -e /usr/include/liburing.h ]; then
	if [ "$(id -u)" = 0 ]; then
		say "installing liburing-dev"
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liburing-dev >/dev/null
	else
		say "liburing-dev is missing and this is not root: run 'sudo apt-get install liburing-dev'"
		exit 1
	fi
fi

# zero_ext itself: rebuilt when its sources changed or the installed copy is another checkout's.
stamp=.deps-stamp
digest=$(find setup.py pyproject.toml csrc kernels -type f | sort | xargs cat | sha256sum | cut -d' ' -f1)
here=$(pwd -P)
installed=$(cd / && "$PY" -c 'import os, zero_ext._C, zero_ext; print(os.path.dirname(os.path.realpath(zero_ext.__file__)))' 2>/dev/null || true)
if [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ] || [ "$installed" != "$here/zero_ext" ]; then
	say "building zero_ext (pip install -e .)"
	"$PY" -m pip install --quiet --no-build-isolation --no-deps -e . 2>&1 | grep -v "Running pip as the 'root' user" || true
	(cd / && "$PY" -c 'import zero_ext._C') || { say "the build did not produce zero_ext._C"; exit 1; }
	echo "$digest" > "$stamp"
fi
# Hugging Face: transformers, accelerate, trl and peft, Lightning, and matplotlib (the estimator CLI's --plot),
# each only if it does not import, then
# zero_ext's `deepspeed`
# compatibility package (compat/, editable) so that they take their DeepSpeed path into zero_ext. A real
# DeepSpeed already installed is left alone (compat/ would replace it; its build refuses to).
hf_missing=$("$PY" - <<'PYEOF'
import importlib.util
print(" ".join(m for m in ("transformers", "accelerate", "trl", "lightning", "peft", "matplotlib") if importlib.util.find_spec(m) is None))
PYEOF
)
if [ -n "$hf_missing" ]; then
	say "installing $hf_missing"
	"$PY" -m pip install --quiet $hf_missing
fi
deepspeed_state=$(cd / && "$PY" - "$here/compat" <<'PYEOF'
import importlib.metadata as m, os, sys
try:
    dist = m.distribution("deepspeed")
except m.PackageNotFoundError:
    print("missing"); sys.exit()
if "zeroext" not in dist.version.split("+", 1)[-1].replace("_", "").replace(".", ""):
    print("foreign " + dist.version); sys.exit()
import importlib.util
spec = importlib.util.find_spec("deepspeed")
where = os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))) if spec and spec.origin else ""
print("ours" if where == os.path.realpath(sys.argv[1]) else "elsewhere")
PYEOF
)
case "$deepspeed_state" in
	missing|elsewhere)
		say "installing zero_ext's deepspeed compatibility package (pip install -e compat)"
		"$PY" -m pip install --quiet --no-build-isolation --no-deps -e compat 2>&1 | grep -v "Running pip as the 'root' user" || true
		(cd / && "$PY" -c 'import deepspeed, zero_ext') || { say "the compat package does not import"; exit 1; } ;;
	foreign*)
		say "a real DeepSpeed (${deepspeed_state#foreign }) is installed: zero_ext's compat package was not installed over it (see README, Using with Hugging Face)" ;;
esac
say "ready"
