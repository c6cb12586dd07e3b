"""``deepspeed.git_version_info``: DeepSpeed's build information, here zero_ext's (``ds_report`` and
test suites read it): the version, the checkout, the ops built in, and the torch this runs on."""
import torch

from . import __git_branch__ as git_branch, __git_hash__ as git_hash, __version__ as version  # noqa: F401
from .ops import __compatible_ops__ as compatible_ops
from .ops.op_builder import ALL_OPS

installed_ops = dict(compatible_ops)  # what zero_ext has is built in, nothing is compiled later
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"


def _major_minor(text):
    return ".".join(str(text).split("+")[0].split(".")[:2]) if text else "0.0"


def _nccl():
    try:
        # the NCCL torch was built with, as DeepSpeed records it at install (no GPU needed to ask)
        return _major_minor(".".join(str(x) for x in torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        return "0.0"


torch_info = {"version": _major_minor(torch.__version__), "bf16_support": True,
              "cuda_version": _major_minor(torch.version.cuda), "nccl_version": _nccl(),
              "hip_version": _major_minor(getattr(torch.version, "hip", None))}

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "compatible_ops", "accelerator_name", "torch_info",
           "ALL_OPS"]
