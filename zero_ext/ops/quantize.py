"""Block quantization: the wire formats of ZeRO++ (csrc/quant.h), int8 for the weights qwZ
all-gathers and int4 for the gradients qgZ reduces. CPU tensors go to the C core (zero_ext._C), CUDA
tensors to the CUDA library's kernels (kernels/quant.cu, on torch's current stream), same format.

    qt = quantize(x, "int8", block=256)     # QuantizedTensor: data (uint8), scales (fp32)
    y = dequantize(qt)                      # x's shape and dtype, within the format's bound
    dequantize(qt, out=acc, accumulate=True)  # acc (fp32) += q * s: quantized pieces summed in fp32

Per block of `block` elements: s = amax / L (L = 127 for int8, 7 for int4), q = rint(x * (L / amax)).
Bound per element: |dequantize(quantize(x)) - x| <= s/2 + 2^-21 (s + |x|) in fp32 (error_bound() gives
it per element), plus the final rounding for a bf16 / fp16 output. A block with a NaN or an infinity
dequantizes to NaN throughout, so an overflow survives the trip. The C kernels' scalar, AVX2 and
AVX-512 paths give the same bits (isa: as zero_ext.ops.functional takes it); the CUDA kernels give
the same integers and scales (verified only where a GPU ran benchmarks/gpu_suite.sh).
"""
from dataclasses import dataclass

import torch

from .. import _C
from .._native import cuda as _cuda
from .._native.dtypes import KERNEL_DTYPES, raw_buffer
from .functional import _sync_threads, isa_code

FORMATS = {"int8": 0, "int4": 1}
LEVELS = {"int8": 127, "int4": 7}


@dataclass
class QuantizedTensor:
    """A tensor in a block-quantized format: `data` holds the integers (one byte each for int8, two
    per byte for int4), `scales` one fp32 scale per block; `shape` and `dtype` are the original's."""
    data: torch.Tensor
    scales: torch.Tensor
    format: str
    block: int
    shape: torch.Size
    dtype: torch.dtype

    def numel(self):
        return self.shape.numel()

    def nbytes(self):
        """Bytes on the wire: the integers and the scales."""
        return self.data.numel() + 4 * self.scales.numel()


def quant_sizes(format, numel, block):
    """(data bytes, number of blocks) of `numel` elements in `format` with blocks of `block`."""
    _check_format(format, block)
    return _C.quant_sizes(FORMATS[format], int(numel), int(block))


def quantize(x, format="int8", block=256, *, out=None, isa=None):
    """x (fp32 / bf16 / fp16, contiguous, CPU or CUDA) in `format`, on x's device. out: a
    QuantizedTensor of the right sizes to write into (a collective's send buffer), else a new one."""
    _check_format(format, block)
    device = x.device if isinstance(x, torch.Tensor) else None
    src, n, dtype = raw_buffer(x, "x", device=_kind(device), dtypes=KERNEL_DTYPES)
    nbytes, nblocks = _C.quant_sizes(FORMATS[format], n, block)
    if out is None:
        out = QuantizedTensor(torch.empty(nbytes, dtype=torch.uint8, device=device),
                              torch.empty(nblocks, dtype=torch.float32, device=device), format, block, x.shape, x.dtype)
    else:
        _check_target(out, format, block, nbytes, nblocks, device)
        out.shape, out.dtype = x.shape, x.dtype
    q, scales = out.data.data_ptr(), out.scales.data_ptr()
    if device.type == "cuda":
        _cuda.check(_cuda.library().zx_cuda_quantize(FORMATS[format], dtype, src, n, block, q, scales,
                                                     _stream(device)), "zx_cuda_quantize")
        return out
    _sync_threads()
    _C.quantize(FORMATS[format], dtype, src, n, block, q, scales, isa_code(isa))
    return out


def dequantize(qt, *, out=None, dtype=None, accumulate=False, isa=None):
    """qt's values as a tensor of qt's shape on qt's device (dtype: qt.dtype unless given), or written
    into `out` (added to it with accumulate, which needs an fp32 `out`)."""
    _check_format(qt.format, qt.block)
    n = qt.numel()
    device = qt.data.device
    nbytes, nblocks = _C.quant_sizes(FORMATS[qt.format], n, qt.block)
    _check_target(qt, qt.format, qt.block, nbytes, nblocks, device)
    if out is None:
        if accumulate:
            raise ValueError("dequantize(accumulate=True) adds into `out`: pass an fp32 out tensor")
        out = torch.empty(qt.shape, dtype=dtype or qt.dtype, device=device)
    elif out.numel() != n:
        raise ValueError(f"out has {out.numel()} elements; the quantized tensor holds {n}")
    if accumulate and out.dtype != torch.float32:
        raise TypeError(f"dequantize(accumulate=True) accumulates in fp32; out is {out.dtype}")
    dst, _, code = raw_buffer(out, "out", device=device.type, dtypes=KERNEL_DTYPES)
    if device.type == "cuda":
        _cuda.check(_cuda.library().zx_cuda_dequantize(FORMATS[qt.format], qt.data.data_ptr(), qt.scales.data_ptr(),
                                                       n, qt.block, code, dst, int(accumulate), _stream(device)),
                    "zx_cuda_dequantize")
        return out
    _sync_threads()
    _C.dequantize(FORMATS[qt.format], qt.data.data_ptr(), qt.scales.data_ptr(), n, qt.block, code, dst,
                  bool(accumulate), isa_code(isa))
    return out


def error_bound(x, qt):
    """The format's bound per element of x (fp32): s/2 + 2^-21 (s + |x|), s the scale of x's block."""
    s = qt.scales.repeat_interleave(qt.block)[: qt.numel()].view(qt.shape)
    return s / 2 + 2.0 ** -21 * (s + x.float().abs())


def _check_format(format, block):
    if format not in FORMATS:
        raise ValueError(f"unknown quantization format {format!r}; use one of {sorted(FORMATS)}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, not {block!r}")
    if format == "int4" and block % 2:
        raise ValueError(f"int4 packs two elements per byte: block must be even, not {block}")


def _kind(device):
    """The device type a kernel here takes x on: "cpu" or "cuda" (anything else is refused by raw_buffer)."""
    return "cuda" if device is not None and device.type == "cuda" else "cpu"


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream


def _check_target(qt, format, block, nbytes, nblocks, device=None):
    """qt's buffers are on `device` (CPU by default), contiguous, of the right types and sizes for this
    format and block."""
    if qt.format != format or qt.block != block:
        raise ValueError(f"quantized tensor is {qt.format} with block {qt.block}; expected {format} / {block}")
    kind = _kind(device)
    raw_buffer(qt.data, "data", device=kind, dtypes=(torch.uint8, torch.int8))
    raw_buffer(qt.scales, "scales", device=kind, dtypes=(torch.float32,))
    if qt.data.numel() != nbytes or qt.scales.numel() != nblocks:
        raise ValueError(f"quantized buffers hold {qt.data.numel()} bytes and {qt.scales.numel()} scales; "
                         f"{nbytes} and {nblocks} are needed")

