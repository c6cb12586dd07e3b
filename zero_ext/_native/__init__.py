"""zero_ext._native: the Python side of the C core's and the CUDA library's calling conventions.

Files:
- planner.py: the layouts computed by the C planner (csrc/planner.c): pieces, shards, buckets.
- dtypes.py: torch dtypes as C codes (csrc/dtype.h) and the checks a tensor passes before its
  address goes to C.
- cuda.py: ``libzx_cuda.so`` (NCCL collectives, CUDA kernels) through ctypes, loaded on first use.
"""
