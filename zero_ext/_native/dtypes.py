"""torch dtypes as the C core names them (csrc/dtype.h), and the checks C cannot make itself.

The C core takes raw pointers and element counts and never sees torch, so everything it cannot check
is checked here, once: dtype, device, layout, contiguity and alignment. A tensor that fails raises
with what to do next. ``zx_dtype`` is the one map from torch dtypes to the C codes; a code the core
does not know is a ValueError, a known one a kernel does not take a TypeError.
"""
import torch

_ZX_DTYPE = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.uint8: 6,
}

# What the CPU optimizer kernels compute in (csrc/cpu_optim.h): fp32 state, 16-bit copies.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def zx_dtype(dtype: torch.dtype) -> int:
    """The C core's code for a torch dtype (ValueError for types it does not handle)."""
    try:
        return _ZX_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"zero_ext's C core does not handle {dtype}; supported: "
                         f"{', '.join(str(d) for d in _ZX_DTYPE)}") from None


def kernel_dtype(dtype: torch.dtype) -> int:
    """zx_dtype for a CPU optimizer kernel's tensors (TypeError for any other than KERNEL_DTYPES)."""
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"no zero_ext C kernel takes {dtype}; use float32, bfloat16 or float16")
    return _ZX_DTYPE[dtype]


def raw_buffer(t: torch.Tensor, name: str, device: str = None, dtypes=None, align: int = 1):
    """(data_ptr, numel, zx dtype) of a tensor about to cross into C, after the checks C cannot make:
    dtype, device, contiguity and alignment. C would silently read garbage from a strided view."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {', '.join(map(str, dtypes))}")
    if device is not None and t.device.type != device:
        raise ValueError(f"{name} is on {t.device}; expected a {device} tensor")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous() (C reads it as one flat buffer)")
    if align > 1 and t.numel() and t.data_ptr() % align:
        raise ValueError(f"{name} is not {align}-byte aligned (address {t.data_ptr():#x})")
    return t.data_ptr(), t.numel(), zx_dtype(t.dtype)


def cpu_ptr(t, name, dtype=torch.float32, numel=None):
    """data_ptr() of `t` after checking that a CPU kernel may read and write it as `numel` elements of
    `dtype`. `t` must be a dense, contiguous CPU tensor of exactly that dtype, naturally aligned.
    Nothing is copied: a tensor that would need a copy is refused, because a kernel writing into a
    copy would silently lose its results."""
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
