"""ZeRO++ qwZ: the parameter all-gather of the forward and backward passes, sent block-quantized.

[Note: quantized all-gather]
Each rank quantizes its piece of every parameter of the gather (``zero_ext.ops.quantize``: int8,
blocks of ``WEIGHT_BLOCK`` elements, one fp32 scale each; the bound is in docs/precision.md) into one
record: the pieces' integers one after another, then (from a 4-byte boundary) their scales. One
all-gather of uint8 moves ``world`` records (a quarter of the fp32 bytes, half of the bf16 / fp16
bytes, plus 4 bytes per block), and every rank dequantizes every record, its own included, into the
parameters' padded storage. So all ranks compute with the same value, the dequantized one, and the
pieces themselves are never written: the optimizer keeps stepping the exact values, as in DeepSpeed.
Pieces are quantized one by one from their own start, so the value a parameter takes does not depend
on which other parameters shared its all-gather (prefetch buckets change from step to step).
"""
from typing import List, Sequence, Tuple

import torch

from .. import comm
from ..ops import records
from ..ops.quantize import QuantizedTensor, dequantize, quant_sizes, quantize

WEIGHT_FORMAT = "int8"
WEIGHT_BLOCK = 2048  # elements per scale: DeepSpeed's qwZ target group size


def record_layout(shards: Sequence[int], format: str = WEIGHT_FORMAT,
                  block: int = WEIGHT_BLOCK) -> Tuple[int, List[Tuple[int, int, int, int]]]:
    """(record bytes, per piece (data offset, data bytes, scale index, scales)) of one rank's record
    for pieces of ``shards`` elements: integers first, then the fp32 scales from a 4-byte boundary."""
    spans, data_end, nscales = [], 0, 0
    for shard in shards:
        nbytes, nblocks = quant_sizes(format, shard, block)
        spans.append((data_end, nbytes, nscales, nblocks))
        data_end += nbytes
        nscales += nblocks
    scales_at = (data_end + 3) // 4 * 4
    return scales_at + 4 * nscales, [(d, nb, scales_at // 4 + s, ns) for d, nb, s, ns in spans]


def all_gather_quantized_async(pieces: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], group,
                               rank: int, world: int, wrap):
    """The quantized form of ``collectives.all_gather_pieces_async`` (world > 1): ``outputs[i]`` (each
    ``world * shard`` elements, rank-major) receive every rank's piece i as dequantized; ``wrap(work,
    finish)`` makes the caller's pending-gather object. On CPU the pieces are quantized in one C call and
    the world records dequantized into the outputs in another (ops/records.py)."""
    shards = [out.numel() // world for out in outputs]
    device = outputs[0].device
    if device.type == "cpu" and _uniform(pieces, outputs, shards):
        layout = records.Layout.of(tuple(shards), (True,) * len(shards), WEIGHT_FORMAT, WEIGHT_BLOCK,
                                   torch.float32)
        rows = torch.empty(world * layout.nbytes, dtype=torch.uint8)
        by_rank = rows.view(world, layout.nbytes)
        srcs = [p if p.device.type == "cpu" and p.is_contiguous() else p.to("cpu").contiguous() for p in pieces]
        records.pack(layout, [by_rank[rank]], [[(p.data_ptr(), p.numel()) for p in srcs]], srcs[0].dtype)
        work = comm.all_gather_into(rows, by_rank[rank], group, async_op=True)
        size = outputs[0].element_size()

        def dequantize_rows():  # every rank's record into its part of every output, one C call
            targets = [[out.data_ptr() + r * shard * size for out, shard in zip(outputs, shards)] for r in range(world)]
            records.unpack(layout, list(by_rank), targets, outputs[0].dtype)
        return wrap(work, dequantize_rows)
    record, spans = record_layout(shards)
    rows = torch.empty(world * record, dtype=torch.uint8, device=device)
    own = rows.view(world, record)[rank]
    for piece, shard, span in zip(pieces, shards, spans):
        quantize(piece.to(device, non_blocking=True), WEIGHT_FORMAT, WEIGHT_BLOCK, out=_quantized(own, shard, span, piece.dtype))
    work = comm.all_gather_into(rows, own, group, async_op=True)

    def dequantize_all():  # after the wait: on CUDA, on the current stream, which now follows the collective
        for r, row in enumerate(rows.view(world, record)):
            for out, shard, span in zip(outputs, shards, spans):
                dequantize(_quantized(row, shard, span, out.dtype), out=out.view(world, shard)[r])
    return wrap(work, dequantize_all)


def _uniform(pieces, outputs, shards) -> bool:
    """The batched path's conditions: one kernel dtype among the pieces and one among the (contiguous)
    outputs, each piece a whole shard."""
    kinds = (torch.float32, torch.bfloat16, torch.float16)
    return (len({p.dtype for p in pieces}) == 1 and pieces[0].dtype in kinds and len({o.dtype for o in outputs}) == 1
            and outputs[0].dtype in kinds and all(o.is_contiguous() for o in outputs)
            and all(p.numel() == s for p, s in zip(pieces, shards)))


def _quantized(row: torch.Tensor, shard: int, span, dtype) -> QuantizedTensor:
    """Piece ``span`` of a rank's record, as a QuantizedTensor viewing it."""
    data_at, nbytes, scale_at, nscales = span
    scales = row[4 * scale_at: 4 * (scale_at + nscales)].view(torch.float32)
    return QuantizedTensor(row[data_at: data_at + nbytes], scales, WEIGHT_FORMAT, WEIGHT_BLOCK,
                           torch.Size([shard]), dtype)
