"""Build backend for the compatibility package: setuptools', behind one check.

Installing a distribution named ``deepspeed`` over Microsoft's DeepSpeed would silently replace it, so
every build hook first asks the interpreter that runs the build whether a ``deepspeed`` distribution
that is not ours is installed, and stops with a message if so. pip builds in an isolated environment
(its PYTHONPATH hides site-packages), so the question goes to a fresh ``python -I`` of the same
interpreter, which sees the site-packages the package is about to be installed into.
"""
import os
import subprocess
import sys

from setuptools import build_meta as _setuptools

OURS = "zeroext"  # the local version label every release of this package carries

_PROBE = r"""
import importlib.metadata as m, json, sys
paths = json.loads(sys.argv[1])
kwargs = {'path': paths} if paths else {}
found = [(d.version, str(d.locate_file(''))) for d in m.distributions(name='deepspeed', **kwargs)]
print(json.dumps(found))
"""


def foreign_deepspeed(paths=None):
    """(version, location) of every installed ``deepspeed`` distribution that is not this package.

    ``paths``: the folders to search (default: the build interpreter's sys.path, without pip's
    isolation). A version whose local label is ``zeroext`` is ours and not reported.
    """
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    out = subprocess.run([sys.executable, "-I", "-c", _PROBE, json.dumps(paths)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return [(v, where) for v, where in json.loads(out) if not is_ours(v)]


def is_ours(version: str) -> bool:
    return "+" in version and OURS in version.split("+", 1)[1].replace("_", "").replace(".", "").replace("-", "")


def refuse_over_real_deepspeed():
    if os.environ.get("ZERO_EXT_ALLOW_DEEPSPEED_OVERWRITE") == "1":
        return
    found = foreign_deepspeed()
    if found:
        version, where = found[0]
        raise SystemExit(
            f"zero_ext compat: DeepSpeed {version} is installed ({where}). This package is also named "
            "'deepspeed' and installing it would replace the real one. Use a separate virtual environment "
            "for zero_ext, or 'pip uninstall deepspeed' first if you mean to replace it "
            "(ZERO_EXT_ALLOW_DEEPSPEED_OVERWRITE=1 skips this check).")


def _checked(hook):
    def run(*args, **kwargs):
        refuse_over_real_deepspeed()
        return hook(*args, **kwargs)
    run.__name__ = hook.__name__
    return run


build_wheel = _checked(_setuptools.build_wheel)
build_editable = _checked(_setuptools.build_editable)
prepare_metadata_for_build_wheel = _checked(_setuptools.prepare_metadata_for_build_wheel)
prepare_metadata_for_build_editable = _checked(_setuptools.prepare_metadata_for_build_editable)
build_sdist = _setuptools.build_sdist
get_requires_for_build_wheel = _setuptools.get_requires_for_build_wheel
get_requires_for_build_editable = _setuptools.get_requires_for_build_editable
get_requires_for_build_sdist = _setuptools.get_requires_for_build_sdist
