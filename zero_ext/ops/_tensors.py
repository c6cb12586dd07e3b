"""Checks a tensor before its address goes to zero_ext._C, which never sees torch.

The C kernels take raw pointers and element counts, so everything C cannot check is checked here:
device, dtype, layout, contiguity and alignment. A tensor that fails raises with what to do next.
"""
import torch

# zx_dtype codes of csrc/dtype.h
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def dtype_code(dtype):
    try:
        return DTYPE_CODE[dtype]
    except KeyError:
        raise TypeError(f"no zero_ext C kernel takes {dtype}; use float32, bfloat16 or float16") from None


def cpu_ptr(t, name, dtype=torch.float32, numel=None):
    """data_ptr() of `t` after checking that C may read and write it as `numel` elements of `dtype`.

    `t` must be a dense, contiguous CPU tensor of exactly that dtype, naturally aligned. Nothing is
    copied: a tensor that would need a copy is refused, because a kernel writing into a copy would
    silently lose its results.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; the CPU optimizer kernels need CPU tensors "
                         "(move it with .cpu(), or enable offload_optimizer: cpu)")
    if t.layout != torch.strided:
        raise ValueError(f"{name} is {t.layout}; the CPU optimizer kernels need dense tensors "
                         "(call .to_dense())")
    if t.dtype != dtype:
        raise TypeError(f"{name} is {t.dtype} but this kernel needs {dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass a contiguous tensor and copy the result back "
                         "(a kernel writing into a .contiguous() copy would lose its results)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel}")
    if t.numel() == 0:
        return 0
    ptr = t.data_ptr()
    if ptr % t.element_size():
        raise ValueError(f"{name} is not aligned to its element size ({t.element_size()} bytes); "
                         "use a fresh tensor or .clone()")
    return ptr
