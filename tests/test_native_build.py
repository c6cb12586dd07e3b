"""The installed package: the C core, the lazily loaded CUDA library, the ISA choice, the build switch."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import zero_ext
from zero_ext import _C
from zero_ext._native import cuda as _cuda
from zero_ext._native.dtypes import raw_buffer, zx_dtype

from helpers import ROOT


def _python(code, **env):
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_import_needs_no_cuda_and_does_not_load_the_cuda_library():
    code = ("import zero_ext, zero_ext._C\n"
            "maps = open('/proc/self/maps').read()\n"
            "print('libzx_cuda' in maps, zero_ext.init_distributed.__name__)")
    out = _python(code, CUDA_VISIBLE_DEVICES="")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "init_distributed"]


def _dynamic_symbols(path):
    if not shutil.which("nm"):
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.split()[1] in "TDB"}


def test_c_core_exports_only_its_init_function():
    assert _dynamic_symbols(_C.__file__) == {"PyInit__C"}


def test_cuda_library_loads_and_exports_only_its_api():
    if not _cuda.available():
        pytest.skip("built without CUDA (no nvcc/NCCL at build time, or ZERO_EXT_CUDA=0)")
    lib = _cuda.library()
    assert lib.zx_cuda_error_string(0) == b"success"
    assert lib.zx_cuda_error_string(-22).startswith(b"invalid argument")
    symbols = _dynamic_symbols(_cuda.LIBRARY)
    assert {s for s in symbols if s.startswith("zx_")} == set(_cuda._SIGNATURES)
    # bad dtypes are refused in C before any CUDA call (this runs without a GPU)
    assert lib.zx_cuda_cast(None, 99, None, 0, 0, None) == -22
    with pytest.raises(_cuda.CudaLibraryError, match="zx_cuda_cast failed: invalid argument"):
        _cuda.check(lib.zx_cuda_cast(None, 99, None, 0, 0, None), "zx_cuda_cast")


def test_missing_cuda_library_is_a_clear_import_error(monkeypatch):
    monkeypatch.setattr(_cuda, "LIBRARY", "/nonexistent/libzx_cuda.so")
    _cuda.library.cache_clear()
    try:
        with pytest.raises(ImportError, match="built without its CUDA library"):
            _cuda.library()
    finally:
        _cuda.library.cache_clear()


@pytest.mark.parametrize("cap", ["scalar", "avx2", "avx512"])
def test_zero_ext_isa_caps_the_simd_path(cap):
    order = ["scalar", "avx2", "avx512"]
    best = _C.simd_supported()
    out = _python("from zero_ext import _C; print(_C.simd_level())", ZERO_EXT_ISA=cap)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == order[min(order.index(cap), order.index(best))]


def test_unknown_isa_is_an_error():
    out = _python("from zero_ext import _C; _C.simd_level()", ZERO_EXT_ISA="sse9")
    assert out.returncode != 0 and "ZERO_EXT_ISA=sse9 is not one of avx512, avx2, scalar" in out.stderr


def test_cuda_switch_names_what_is_missing():
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "ZERO_EXT_CUDA": "1", "CUDA_HOME": "/nonexistent"}, timeout=60)
    assert out.returncode != 0
    assert "ZERO_EXT_CUDA=1 but the CUDA library cannot be built; missing: nvcc (not found in " \
           "CUDA_HOME=/nonexistent/bin)" in out.stderr
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "ZERO_EXT_CUDA": "maybe"}, timeout=60)
    assert out.returncode != 0 and "ZERO_EXT_CUDA must be 0, 1 or auto" in out.stderr


def test_raw_buffer_checks_what_c_cannot():
    t = torch.zeros(4, 6)
    ptr, n, code = raw_buffer(t, "t", device="cpu", dtypes=(torch.float32,), align=64)
    assert (ptr, n, code) == (t.data_ptr(), 24, zx_dtype(torch.float32))
    with pytest.raises(ValueError, match="t is not contiguous"):
        raw_buffer(t.t(), "t")
    with pytest.raises(TypeError, match="has dtype torch.float64"):
        raw_buffer(t.double(), "t", dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="expected a cuda tensor"):
        raw_buffer(t, "t", device="cuda")
    with pytest.raises(ValueError, match="not 64-byte aligned"):
        raw_buffer(t.view(-1)[1:], "t", align=64)
    with pytest.raises(ValueError, match="does not handle torch.complex64"):
        zx_dtype(torch.complex64)


def test_version():
    assert zero_ext.__version__ == "0.1.0"
