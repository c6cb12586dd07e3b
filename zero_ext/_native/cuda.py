"""The CUDA library (libzx_cuda.so: NCCL collectives, CUDA kernels), loaded on first use only.

It is a plain C library (csrc/cuda_api.h), not a Python extension, loaded with ctypes: `import zero_ext`
never touches CUDA or NCCL; the engine calls it for CUDA tensors only (comm/nccl.py: the collectives;
``cast_into``: fp32 master -> 16-bit parameters, the all-gather's input, in one kernel). One build
serves any Python and torch on the GPU machine. ctypes releases the GIL around every call.
UNVERIFIED on a GPU until benchmarks/gpu_suite.sh ran (the tests marked ``gpu``).
"""
import ctypes
import functools
import os

import torch

from .dtypes import zx_dtype  # noqa: F401  (re-exported for callers passing dtypes)

# built beside zero_ext/_C (setup.py), one folder up from here
LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "libzx_cuda.so")
NCCL_ID_BYTES = 128

_c_int, _c_size, _c_ll, _vp = ctypes.c_int, ctypes.c_size_t, ctypes.c_longlong, ctypes.c_void_p
_SIGNATURES = {
    "zx_cuda_error_string": ([_c_int], ctypes.c_char_p),
    "zx_nccl_unique_id": ([ctypes.c_char_p], _c_int),
    "zx_nccl_comm_init": ([ctypes.POINTER(_vp), _c_int, _c_int, ctypes.c_char_p], _c_int),
    "zx_nccl_comm_destroy": ([_vp], _c_int),
    "zx_nccl_comm_abort": ([_vp], _c_int),
    "zx_nccl_all_gather": ([_vp, _vp, _vp, _c_size, _c_int, _vp], _c_int),
    "zx_nccl_reduce_scatter": ([_vp, _vp, _vp, _c_size, _c_int, _c_int, _vp], _c_int),
    "zx_nccl_all_reduce": ([_vp, _vp, _vp, _c_size, _c_int, _c_int, _vp], _c_int),
    "zx_nccl_broadcast": ([_vp, _vp, _vp, _c_size, _c_int, _c_int, _vp], _c_int),
    "zx_nccl_group_start": ([], _c_int),
    "zx_nccl_group_end": ([], _c_int),
    "zx_cuda_cast": ([_vp, _c_int, _vp, _c_int, _c_size, _vp], _c_int),
    "zx_cuda_quantize": ([_c_int, _c_int, _vp, _c_ll, _c_ll, _vp, _vp, _vp], _c_int),
    "zx_cuda_dequantize": ([_c_int, _vp, _vp, _c_ll, _c_ll, _c_int, _vp, _c_int, _vp], _c_int),
}


class CudaLibraryError(RuntimeError):
    """A call into libzx_cuda.so failed; the message carries NCCL's or CUDA's own error text."""


def available() -> bool:
    """Whether this install has the CUDA library (built where nvcc and NCCL were found)."""
    return os.path.exists(LIBRARY)


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The loaded library, with argument types declared; raises ImportError when it was not built."""
    if not available():
        raise ImportError(
            "zero_ext was built without its CUDA library (libzx_cuda.so): nvcc or NCCL was not found at "
            "build time, or ZERO_EXT_CUDA=0 was set. Rebuild with ZERO_EXT_CUDA=1 pip install . to see "
            "what is missing.")
    lib = ctypes.CDLL(LIBRARY)
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def check(status: int, what: str) -> None:
    """Raises CudaLibraryError for a non-zero status returned by the library."""
    if status != 0:
        text = library().zx_cuda_error_string(status).decode()
        raise CudaLibraryError(f"{what} failed: {text} (status {status})")


_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def on_engine_path() -> bool:
    """Whether the engine calls this library (the NCCL transport of comm/nccl.py, ``cast_into``):
    ``ZERO_EXT_CUDA_LIB=1``. Off by default until benchmarks/gpu_suite.sh (which sets it) has run on a
    GPU; without it CUDA tensors take torch.distributed's NCCL and torch's copies, as before."""
    return os.environ.get("ZERO_EXT_CUDA_LIB", "0").strip() == "1"


def cast_into(dst: "torch.Tensor", src: "torch.Tensor") -> bool:
    """dst = src converted (fp32 / fp16 / bf16, round to nearest even) by kernels/cast.cu on torch's
    current stream, for contiguous CUDA tensors of one device and one size; False (nothing done) where
    that does not apply or the library was not built: the caller copies with torch then."""
    if not (dst.is_cuda and src.is_cuda and dst.device == src.device and dst.dtype in _CASTABLE
            and src.dtype in _CASTABLE and dst.numel() == src.numel() and dst.is_contiguous()
            and src.is_contiguous() and on_engine_path() and available()):
        return False
    stream = torch.cuda.current_stream(dst.device).cuda_stream
    check(library().zx_cuda_cast(src.data_ptr(), zx_dtype(src.dtype), dst.data_ptr(), zx_dtype(dst.dtype),
                                 dst.numel(), stream), "cast")
    return True
