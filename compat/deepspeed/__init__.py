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

from . import comm, zero, utils, ops, runtime, checkpoint, accelerator  # noqa: E402,F401

zero_ext_version = _zero_ext.__version__


def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
    """DeepSpeed's automatic tensor parallelism: not in zero_ext (data-parallel ZeRO only)."""
    raise NotImplementedError("deepspeed.tp_model_init: zero_ext implements data-parallel ZeRO only, not tensor "
                              'parallelism; remove "tensor_parallel" (autotp_size) from the DeepSpeed config')


__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "ZeroEngine", "zero",
           "comm", "utils", "ops", "runtime", "checkpoint", "accelerator", "OffloadDeviceEnum",
           "OffloadStateTypeEnum", "tp_model_init", "__version__"]
