"""Quantized records: one rank's row of a quantized collective (ZeRO++'s qwZ all-gather, qgZ's all-to-all),
packed and unpacked in one C call each (csrc/quant.h's batches) instead of one call per piece.

A record holds pieces one after another, each quantized (``format``, blocks of ``block`` elements, from
the piece's own start) or raw (its elements unquantized, starting on their element size), then every
quantized piece's fp32 scales from a 4-byte boundary. The layout depends only on the pieces' sizes and
kinds, so it is computed once per shape of bucket (``Layout.of``, cached) and each call only adds the
buffers' addresses to it.

    layout = Layout.of((1000, 3), (True, False), "int4", 512, torch.float32)
    pack(layout, [(src_ptr, valid), ...], dtype, record)        # every piece into one record
    unpack(layout, [record, ...], [[dst_ptr per piece], ...], dtype, accumulate=True)
    requantize(layout, [[record, ...] per output], wide, [output record, ...], dtype)  # sums, quantized again
"""
import functools
from typing import List, Sequence, Tuple

import torch

from .. import _C
from .._native.dtypes import raw_buffer
from .functional import _sync_threads, isa_code
from .quantize import FORMATS, quant_sizes

RAW = 2  # csrc/quant.h's ZX_QUANT_RAW
_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class Layout:
    """Where each piece of a record lies: ``spans[i] = (data offset, scales offset)`` in bytes (scales
    offset -1 for a raw piece); ``nbytes`` the record's size."""

    def __init__(self, numels: Tuple[int, ...], quantized: Tuple[bool, ...], format: str, block: int,
                 raw_dtype: torch.dtype):
        self.numels, self.quantized, self.format, self.block = numels, quantized, format, block
        self.code = FORMATS[format]
        size = raw_dtype.itemsize
        at, nscales, data = 0, 0, []
        for numel, q in zip(numels, quantized):
            if q:
                nbytes, nblocks = quant_sizes(format, numel, block)
            else:
                at = (at + size - 1) // size * size
                nbytes, nblocks = numel * size, 0
            data.append((at, nscales))
            at += nbytes
            nscales += nblocks
        scales_at = (at + 3) // 4 * 4
        self.nbytes = scales_at + 4 * nscales
        self.spans = [(d, scales_at + 4 * s if q else -1) for (d, s), q in zip(data, quantized)]

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(numels: Tuple[int, ...], quantized: Tuple[bool, ...], format: str, block: int,
           raw_dtype: torch.dtype) -> "Layout":
        return Layout(numels, quantized, format, block, raw_dtype)


def _record_ptr(record: torch.Tensor, layout: Layout) -> int:
    ptr, n, _ = raw_buffer(record, "record", device="cpu", dtypes=(torch.uint8,))
    if n < layout.nbytes:
        raise ValueError(f"a record of {layout.nbytes} bytes does not fit in {n}")
    return ptr


def pack(layout: Layout, records: Sequence[torch.Tensor], sources: Sequence[Sequence[Tuple[int, int]]],
         dtype: torch.dtype, isa=None) -> None:
    """Quantizes (or copies, for raw pieces) ``sources[k][i] = (address, valid elements)`` of ``dtype`` into
    piece i of ``records[k]``, every record in one C call. A piece's elements past ``valid`` must
    already be zero in the record (records from torch.zeros): they and their blocks' scales stay 0,
    which is what quantizing the zero padding would write."""
    code, items = _CODES[dtype], []
    for record, row in zip(records, sources):
        base = _record_ptr(record, layout)
        for (data_at, scales_at), q, (src, valid) in zip(layout.spans, layout.quantized, row):
            items += (src, base + data_at, base + scales_at if q else 0, valid, layout.code if q else RAW, code)
    _sync_threads()
    _C.quantize_batch(items, layout.block, isa_code(isa))


def unpack(layout: Layout, records: Sequence[torch.Tensor], targets: Sequence[Sequence[int]], dtype: torch.dtype,
           accumulate: bool = False, isa=None) -> None:
    """Dequantizes piece i of ``records[k]`` into address ``targets[k][i]`` (``layout.numels[i]`` elements of
    ``dtype``; raw pieces are read as ``dtype`` too), in one C call. With ``accumulate`` every record adds
    into the same targets (``targets`` holds one row, fp32), record by record in order."""
    items: List[int] = []
    bases = [_record_ptr(r, layout) for r in records]
    code = _CODES[dtype]
    if accumulate:  # grouped by piece: the records of one piece in order
        for i, ((data_at, scales_at), q, n) in enumerate(zip(layout.spans, layout.quantized, layout.numels)):
            for base in bases:
                items += (base + data_at, targets[0][i], base + scales_at if q else 0, n,
                          layout.code if q else RAW, 0 if q else code)
        group = len(bases)
    else:
        for base, row in zip(bases, targets):
            for (data_at, scales_at), q, n, dst in zip(layout.spans, layout.quantized, layout.numels, row):
                items += (base + data_at, dst, base + scales_at if q else 0, n, layout.code if q else RAW, code)
        group = 1
    if not items:
        return
    _sync_threads()
    _C.dequantize_batch(items, group, layout.block, accumulate, isa_code(isa))


def requantize(layout: Layout, groups: Sequence[Sequence[torch.Tensor]], out_layout: Layout,
               outs: Sequence[torch.Tensor], dtype: torch.dtype, isa=None) -> None:
    """``outs[g]`` (records of ``out_layout``: the same pieces, raw ones fp32) receives the fp32 sum of the
    records ``groups[g]`` (of ``layout``; raw pieces read as ``dtype``), added piece by piece in record
    order from zero, quantized again: the bits of ``unpack(..., accumulate=True)`` into a zeroed fp32 run
    followed by ``pack`` of it, in one C call that keeps no fp32 run (a tile's sum stays in cache)."""
    if out_layout.numels != layout.numels or out_layout.quantized != layout.quantized or \
            out_layout.block != layout.block:
        raise ValueError("requantize: the output records must hold the same pieces, blocks and kinds")
    if len(groups) != len(outs) or len({len(g) for g in groups}) > 1:
        raise ValueError("requantize: one output per group, every group as long")
    items: List[int] = []
    out_items: List[int] = []
    code = _CODES[dtype]
    wide = _CODES[torch.float32]
    for group, out in zip(groups, outs):
        bases = [_record_ptr(r, layout) for r in group]
        out_base = _record_ptr(out, out_layout)
        for i, (q, n) in enumerate(zip(layout.quantized, layout.numels)):
            (data_at, scales_at), (out_data, out_scales) = layout.spans[i], out_layout.spans[i]
            for base in bases:
                items += (base + data_at, 0, base + scales_at if q else 0, n,
                          layout.code if q else RAW, wide if q else code)
            out_items += (0, out_base + out_data, out_base + out_scales if q else 0, n,
                          out_layout.code if q else RAW, wide)
    if not out_items:
        return
    _sync_threads()
    _C.requantize_batch(items, len(groups[0]), out_items, layout.block, isa_code(isa))
