"""``deepspeed.utils.torch``: the torch-version check scripts and tests use."""
import torch
from torch.torch_version import TorchVersion


def required_torch_version(min_version=None, max_version=None) -> bool:
    """Whether the running torch is at least ``min_version`` and at most ``max_version`` (either may be
    omitted, not both)."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version, max_version or both")
    running = TorchVersion(torch.__version__.split("+")[0])
    if min_version is not None and running < str(min_version):
        return False
    return max_version is None or running <= str(max_version)
