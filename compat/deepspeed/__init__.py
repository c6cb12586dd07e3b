"""``deepspeed``, played by zero_ext: every name here is zero_ext's (see compat/README.md).

Libraries that look DeepSpeed up by its import and distribution name (transformers' Trainer,
accelerate) find this package and call zero_ext through it. It is not Microsoft DeepSpeed:
``deepspeed.__version__`` carries the local label ``+zeroext``.
"""
import importlib.metadata as _metadata

def _installed_version():
    """The version the installed metadata gives, and a refusal when that metadata is not ours: files of
    this package under another 'deepspeed' distribution's record mean two installs were mixed."""
    try:
        version = _metadata.version("deepspeed")
    except _metadata.PackageNotFoundError:
        return "0.19.6+zeroext.source"  # imported from a source tree: no metadata to check
    if "zeroext" not in version.split("+", 1)[-1].replace("_", "").replace(".", ""):
        raise ImportError(f"the installed 'deepspeed' distribution is version {version}, but this 'deepspeed' "
                          f"package ({__file__}) is zero_ext's compatibility layer: a real DeepSpeed and zero_ext's "
                          "compat were installed over each other. Reinstall one of them in a clean environment.")
    return version


__version__ = _installed_version()  # checked before zero_ext (and torch) is imported: a mixed install fails fast

try:
    import zero_ext as _zero_ext
except ImportError as _err:  # pragma: no cover - the message is the point
    raise ImportError("this 'deepspeed' package is zero_ext's compatibility layer and needs zero_ext: build it "
                      "from its checkout (pip install -e <zero_ext checkout>, or scripts/setup.sh there)") from _err
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("+")[0].split(".")[:3])

from zero_ext import (DeepSpeedEngine, OffloadDeviceEnum, OffloadStateTypeEnum, ZeroEngine,  # noqa: E402,F401
                      add_config_arguments, init_distributed, initialize)

from . import comm, zero, utils, ops, runtime, checkpoint, accelerator, moe  # noqa: E402,F401
from .runtime.activation_checkpointing import checkpointing  # noqa: E402,F401  (DeepSpeed's deepspeed.checkpointing)
from .runtime.config import DeepSpeedConfig, DeepSpeedConfigError  # noqa: E402,F401  (DeepSpeed's top-level names)
from .utils import OnDevice  # noqa: E402,F401
from .accelerator import get_accelerator  # noqa: E402,F401  (DeepSpeed's top-level name)

zero_ext_version = _zero_ext.__version__


def _git_head(package_dir):
    """The commit zero_ext's checkout is at, read from its .git (a worktree's .git file is followed); DeepSpeed's
    '[none]' when zero_ext is not imported from a git checkout. Reads two or three small files, runs no git."""
    import os

    try:
        git = os.path.join(os.path.dirname(package_dir), ".git")
        if os.path.isfile(git):  # a worktree or submodule: "gitdir: <path>"
            with open(git) as f:
                git = os.path.join(os.path.dirname(package_dir), f.read().split(":", 1)[1].strip())
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head[:7], "[detached]"
        ref = head.split(None, 1)[1]
        for base in (git, _common_dir(git)):
            path = os.path.join(base, ref)
            if os.path.exists(path):
                with open(path) as f:
                    return f.read().strip()[:7], ref.rsplit("/", 1)[-1]
            packed = os.path.join(base, "packed-refs")
            if os.path.exists(packed):
                with open(packed) as f:
                    for line in f:
                        if line.rstrip().endswith(" " + ref):
                            return line[:7], ref.rsplit("/", 1)[-1]
    except (OSError, IndexError):
        pass
    return "[none]", "[none]"


def _common_dir(git):
    import os

    try:
        with open(os.path.join(git, "commondir")) as f:
            return os.path.normpath(os.path.join(git, f.read().strip()))
    except OSError:
        return git


# DeepSpeed's build information: here zero_ext's checkout (short hash and branch), or "[none]".
__git_hash__, __git_branch__ = _git_head(__import__("os").path.dirname(_zero_ext.__file__))


def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
    """DeepSpeed's automatic tensor parallelism: not in zero_ext (data-parallel ZeRO only)."""
    raise NotImplementedError("deepspeed.tp_model_init: zero_ext implements data-parallel ZeRO only, not tensor "
                              'parallelism; remove "tensor_parallel" (autotp_size) from the DeepSpeed config')


__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "ZeroEngine", "zero",
           "comm", "utils", "ops", "runtime", "checkpoint", "accelerator", "get_accelerator", "OffloadDeviceEnum",
           "OffloadStateTypeEnum", "tp_model_init", "moe", "checkpointing", "DeepSpeedConfig",
           "DeepSpeedConfigError", "OnDevice", "__version__", "__git_hash__", "__git_branch__"]
