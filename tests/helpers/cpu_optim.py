"""Shared by the C CPU optimizer tests (tests/test_ops_cpu_*.py): the ISA paths this machine runs, whether
torch's own kernels are vectorised (with FMA) here, and a fixture that runs the kernels on two threads."""
import pytest
import torch

from zero_ext.ops import functional as F

ISAS = F.available_isas()
# torch's vectorised kernels use FMA in lerp/addcmul/add(alpha); its scalar build does not
TORCH_VECTORISED = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.fixture
def two_threads():
    F.set_num_threads(2)
    yield
    F.set_num_threads(None)
