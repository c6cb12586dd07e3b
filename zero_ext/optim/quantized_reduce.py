"""ZeRO++ qgZ: stage 3's gradient reduce-scatter, sent block-quantized through one all-to-all.

[Note: quantized reduce-scatter]
A bucket of full gradients is laid out rank-major (block r holds piece r of every parameter, as for the
plain reduce-scatter). Each rank quantizes its block r for every r (``zero_ext.ops.quantize``: int4,
``GRAD_BLOCK`` elements per fp32 scale), each piece on its own from its start, into record r; one
all-to-all sends record r to rank r; each rank then dequantizes the ``world`` records it received into
an fp32 sum, rank by rank in rank order, one rounding each (``accumulate``), and that sum is its reduced
block. One-dimensional parameters (biases, norms: few bytes, and sensitive) travel unquantized in the
same record, as DeepSpeed keeps them out of qgZ. The wire carries half a byte per element plus 4 bytes
per block instead of 2 (bf16) or 4 (fp32); the error per element and rank is the int4 bound of
docs/precision.md. Pieces are quantized one by one, so a parameter's reduced gradient does not depend on
which others shared its bucket.
"""
from typing import List, Sequence, Tuple

import torch

from .. import comm
from ..ops.quantize import QuantizedTensor, dequantize, quant_sizes, quantize

GRAD_FORMAT = "int4"
GRAD_BLOCK = 512  # elements per scale: int4 keeps 3 bits of magnitude, so blocks stay small


def record_layout(pieces: Sequence[Tuple[int, bool]], dtype: torch.dtype) -> Tuple[int, List[tuple]]:
    """(record bytes, per piece (data offset, data bytes, scale index, scales)) for pieces given as
    (elements, quantized): quantized pieces' integers, the raw bytes (dtype) of the others, then the fp32
    scales from a 4-byte boundary. Raw pieces start on their element size."""
    spans, at, nscales = [], 0, 0
    size = dtype.itemsize
    for numel, quantized in pieces:
        if quantized:
            nbytes, nblocks = quant_sizes(GRAD_FORMAT, numel, GRAD_BLOCK)
        else:
            at = (at + size - 1) // size * size
            nbytes, nblocks = numel * size, 0
        spans.append((at, nbytes, nscales, nblocks))
        at += nbytes
        nscales += nblocks
    scales_at = (at + 3) // 4 * 4
    return scales_at + 4 * nscales, [(d, nb, scales_at // 4 + s, ns) for d, nb, s, ns in spans]


def reduce_scatter_quantized(buf: torch.Tensor, block: int, pieces: Sequence[Tuple[int, int, bool]], group,
                             rank: int, world: int) -> torch.Tensor:
    """The fp32 sum over ranks of block ``rank`` of ``buf`` (``world * block`` elements, rank-major), the
    blocks sent quantized (see [Note: quantized reduce-scatter]). ``pieces``: (offset in a block,
    elements, quantized) of each piece, the same on every rank. Collective over ``group``."""
    record, spans = record_layout([(n, q) for _, n, q in pieces], buf.dtype)
    send = torch.empty(world * record, dtype=torch.uint8, device=buf.device)
    for r, (row, src) in enumerate(zip(send.view(world, record), buf.view(world, block))):
        for (offset, numel, quantized), span in zip(pieces, spans):
            part = src[offset: offset + numel]
            if quantized:
                quantize(part, GRAD_FORMAT, GRAD_BLOCK, out=_quantized(row, span, numel, buf.dtype))
            else:
                _raw(row, span, buf.dtype).copy_(part)
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group)
    total = torch.zeros(block, dtype=torch.float32, device=buf.device)
    for row in recv.view(world, record):  # rank order: the sum's rounding does not depend on timing
        for (offset, numel, quantized), span in zip(pieces, spans):
            out = total[offset: offset + numel]
            if quantized:
                dequantize(_quantized(row, span, numel, buf.dtype), out=out, accumulate=True)
            else:
                out.add_(_raw(row, span, buf.dtype))
    return total


def _quantized(row: torch.Tensor, span, numel: int, dtype) -> QuantizedTensor:
    data_at, nbytes, scale_at, nscales = span
    scales = row[4 * scale_at: 4 * (scale_at + nscales)].view(torch.float32)
    return QuantizedTensor(row[data_at: data_at + nbytes], scales, GRAD_FORMAT, GRAD_BLOCK, torch.Size([numel]), dtype)


def _raw(row: torch.Tensor, span, dtype) -> torch.Tensor:
    data_at, nbytes, _, _ = span
    return row[data_at: data_at + nbytes].view(dtype)
