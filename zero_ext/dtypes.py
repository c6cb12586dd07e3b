"""torch dtypes as the C core names them (csrc/dtype.h), and the checks C cannot make itself."""
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


def zx_dtype(dtype: torch.dtype) -> int:
    """The C core's code for a torch dtype (ValueError for types it does not handle)."""
    try:
        return _ZX_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"zero_ext's C core does not handle {dtype}; supported: "
                         f"{', '.join(str(d) for d in _ZX_DTYPE)}") from None


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
