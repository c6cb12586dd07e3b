"""ZeRO++ qgZ: stage 3's gradient reduce-scatter, sent block-quantized through all-to-alls.

[Note: quantized reduce-scatter]
A bucket's full gradients are cut as for the plain reduce-scatter: piece d of every parameter (its
``shard`` elements from ``d * shard``, zero-padded) belongs to rank d. A rank's record for destination
d holds piece d of every parameter, each quantized on its own from its start (int4, ``GRAD_BLOCK``
elements per fp32 scale; ops/records.py), 1-D parameters (biases, norms: few bytes, and sensitive) raw,
as DeepSpeed keeps them out of qgZ. Pieces are quantized one by one, so a parameter's reduced gradient
does not depend on which others shared its bucket. Records are packed straight from the gradients and
unpacked into the fp32 sum in one C call each.

- One level (a world of one node): one all-to-all sends record d to rank d; each rank adds the
  ``world`` records it received into an fp32 sum, rank by rank in rank order, one rounding each.
- Two levels (``Hierarchy``: the world cut into nodes of L consecutive ranks, M nodes), as DeepSpeed's
  all_to_all_quant_reduce: rank (n, l) = n L + l first sends, over its node, to each local peer j the M
  records of the ranks (n', j); it adds the L records it got for each (n', l) in local order (the
  node's partial sum, fp32), quantizes the M partial sums again (int4; raw pieces now fp32), and sends
  partial n' to rank (n', l) over the ranks sharing its local index; the M partials are added in node
  order. Only that second all-to-all crosses nodes: M - 1 records of a 1/world piece each, L times less
  than the one-level all-to-all sends across. The error per element is the int4 bound of
  docs/precision.md per rank on the first level, plus that of the partial sums' quantization.

The wire carries half a byte per element plus 4 bytes per block instead of 2 (bf16) or 4 (fp32).
"""
from typing import List, Optional, Sequence, Tuple

import torch

from .. import comm
from ..ops import records
from ..ops.quantize import QuantizedTensor, dequantize, quant_sizes, quantize

GRAD_FORMAT = "int4"
GRAD_BLOCK = 512  # elements per scale: int4 keeps 3 bits of magnitude, so blocks stay small


class Hierarchy:
    """qgZ's two levels: this rank's node group (L consecutive ranks) and its cross group (the ranks with
    its local index in every node)."""

    def __init__(self, node_group, cross_group, node_size: int, rank: int, world: int):
        self.node_group, self.cross_group, self.size = node_group, cross_group, node_size
        self.nodes, self.node, self.local = world // node_size, rank // node_size, rank % node_size

    @staticmethod
    def build(node_size: int, world: int, rank: int, new_group) -> Optional["Hierarchy"]:
        """The groups for nodes of ``node_size`` ranks (every rank creates every group, as torch.distributed
        requires), or None where one level is all there is (one node, or nodes of one rank)."""
        if node_size <= 1 or node_size >= world or world % node_size:
            return None
        node = cross = None
        for start in range(0, world, node_size):
            group = new_group(list(range(start, start + node_size)))
            if start <= rank < start + node_size:
                node = group
        for local in range(node_size):
            group = new_group(list(range(local, world, node_size)))
            if rank % node_size == local:
                cross = group
        return Hierarchy(node, cross, node_size, rank, world)


class PendingReduce:
    """A quantized reduce-scatter in flight: ``wait()`` finishes it (once) and gives the fp32 block."""

    def __init__(self, finish):
        self._finish, self._result = finish, None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result


def reduce_scatter_quantized(grads: Sequence[torch.Tensor], shards: Sequence[int], quantized: Sequence[bool], group,
                             rank: int, world: int, hierarchy: Optional[Hierarchy] = None) -> PendingReduce:
    """The fp32 sum over ranks of this rank's piece of every gradient in ``grads`` (full, flat, contiguous,
    one dtype; piece r of gradient i is ``shards[i]`` elements from ``r * shards[i]``), laid end to end:
    ``sum(shards)`` elements. ``quantized[i]``: whether gradient i travels as int4 (else raw). Collective
    over ``group`` (the world of ``world`` ranks), in two levels with a ``hierarchy``. The gradients are
    read before this returns; the first all-to-all is then in flight, and ``wait()`` on the result
    finishes the reduction (the second level's all-to-all runs there, synchronously)."""
    dtype = grads[0].dtype
    layout = records.Layout.of(tuple(shards), tuple(quantized), GRAD_FORMAT, GRAD_BLOCK, dtype)
    if hierarchy is None:
        order = list(range(world))
    else:  # by destination local index, then node: chunk j of the node all-to-all goes to local peer j
        order = [n * hierarchy.size + j for j in range(hierarchy.size) for n in range(hierarchy.nodes)]
    send = torch.zeros(world * layout.nbytes, dtype=torch.uint8)  # zeros: the padding past a gradient's end
    rows = send.view(world, layout.nbytes)
    records.pack(layout, list(rows), [_pieces(grads, shards, d) for d in order], dtype)
    recv = torch.empty_like(send)
    if hierarchy is None:
        work = comm.all_to_all_single(recv, send, group=group, async_op=True)

        def finish():
            work.wait()
            return _sum(layout, list(recv.view(world, layout.nbytes)), shards, dtype)
        return PendingReduce(finish)
    work = comm.all_to_all_single(recv, send, group=hierarchy.node_group, async_op=True)

    def second_level():
        work.wait()
        return _across_nodes(hierarchy, layout, recv, shards, quantized, dtype)
    return PendingReduce(second_level)


def _across_nodes(h: Hierarchy, layout: records.Layout, recv: torch.Tensor, shards, quantized, dtype) -> torch.Tensor:
    """The second level: the node's partial sums for (n', this local index), quantized again (one C call:
    summed and quantized tile by tile, no fp32 partials), sent to their nodes, added in node order."""
    got = recv.view(h.size, h.nodes, layout.nbytes)  # [local peer i][node n'] for rank (n', my local index)
    wide = records.Layout.of(tuple(shards), tuple(quantized), GRAD_FORMAT, GRAD_BLOCK, torch.float32)
    send = torch.empty(h.nodes * wide.nbytes, dtype=torch.uint8)
    records.requantize(layout, [list(got[:, n]) for n in range(h.nodes)], wide,
                       list(send.view(h.nodes, wide.nbytes)), dtype)
    recv2 = torch.empty_like(send)
    comm.all_to_all_single(recv2, send, group=h.cross_group)
    return _sum(wide, list(recv2.view(h.nodes, wide.nbytes)), shards, torch.float32)


def _pieces(grads: Sequence[torch.Tensor], shards: Sequence[int], d: int, whole: bool = False) -> List[Tuple[int, int]]:
    """(address, real elements) of piece ``d`` of each gradient (``whole``: each tensor is the piece)."""
    out = []
    for g, shard in zip(grads, shards):
        if whole:
            out.append((g.data_ptr(), g.numel()))
            continue
        valid = max(0, min(shard, g.numel() - d * shard))
        out.append((g.data_ptr() + d * shard * g.element_size() if valid else 0, valid))
    return out


def _sum(layout: records.Layout, rows: List[torch.Tensor], shards: Sequence[int], dtype, out=None) -> torch.Tensor:
    """The records' pieces added into one fp32 run of ``sum(shards)`` elements (``out``, zeros, or a new
    one), record by record in order."""
    total = torch.zeros(sum(shards), dtype=torch.float32) if out is None else out
    targets, at = [], total.data_ptr()
    for shard in shards:
        targets.append(at)
        at += 4 * shard
    records.unpack(layout, rows, [targets], dtype, accumulate=True)
    return total


# ---------------------------------------------------------------------------------------------------
# Devices the C batches do not reach (CUDA)

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


def reduce_scatter_per_piece(buf: torch.Tensor, block: int, pieces: Sequence[Tuple[int, int, bool]], group,
                             rank: int, world: int, hierarchy: Optional[Hierarchy] = None) -> torch.Tensor:
    """qgZ on a device (CUDA) where the C batches do not run: one (de)quantize call per piece and record,
    in one level or, with a ``hierarchy``, two (the Note's steps, the same records and sums as the C
    batches: the same bits). The fp32 sum over ranks of block ``rank`` of ``buf`` (``world * block``
    elements, rank-major). ``pieces``: (offset in a block, elements, quantized) of each piece, the same on
    every rank. Collective over ``group`` (the world), synchronous."""
    record, spans = record_layout([(n, q) for _, n, q in pieces], buf.dtype)
    blocks = buf.view(world, block)
    send = torch.empty(world * record, dtype=torch.uint8, device=buf.device)
    if hierarchy is None:
        order = range(world)
    else:  # by destination local index, then node (as reduce_scatter_quantized)
        order = [n * hierarchy.size + j for j in range(hierarchy.size) for n in range(hierarchy.nodes)]
    for row, d in zip(send.view(world, record), order):
        _pack_row(row, blocks[d], pieces, spans, buf.dtype)
    recv = torch.empty_like(send)
    if hierarchy is None:
        comm.all_to_all_single(recv, send, group=group)
        return _sum_rows(recv.view(world, record), block, pieces, spans, buf.dtype)
    h = hierarchy
    comm.all_to_all_single(recv, send, group=h.node_group)
    got = recv.view(h.size, h.nodes, record)  # [local peer i][node n'] for rank (n', my local index)
    wide, wide_spans = record_layout([(n, q) for _, n, q in pieces], torch.float32)
    send2 = torch.empty(h.nodes * wide, dtype=torch.uint8, device=buf.device)
    for n, row in enumerate(send2.view(h.nodes, wide)):  # the node's partial sum, quantized again
        _pack_row(row, _sum_rows(got[:, n], block, pieces, spans, buf.dtype), pieces, wide_spans, torch.float32)
    recv2 = torch.empty_like(send2)
    comm.all_to_all_single(recv2, send2, group=h.cross_group)
    return _sum_rows(recv2.view(h.nodes, wide), block, pieces, wide_spans, torch.float32)


def _pack_row(row: torch.Tensor, src: torch.Tensor, pieces, spans, dtype) -> None:
    """One record (record_layout) of ``src``'s pieces: quantized ones as int4 blocks, the others raw."""
    for (offset, numel, quantized), span in zip(pieces, spans):
        part = src[offset: offset + numel]
        if quantized:
            quantize(part, GRAD_FORMAT, GRAD_BLOCK, out=_quantized(row, span, numel, dtype))
        else:
            _raw(row, span, dtype).copy_(part)


def _sum_rows(rows: torch.Tensor, block: int, pieces, spans, dtype) -> torch.Tensor:
    """The records ``rows`` added into a new fp32 block, record by record in order (so the sum's rounding
    does not depend on timing)."""
    total = torch.zeros(block, dtype=torch.float32, device=rows.device)
    for row in rows:
        for (offset, numel, quantized), span in zip(pieces, spans):
            out = total[offset: offset + numel]
            if quantized:
                dequantize(_quantized(row, span, numel, dtype), out=out, accumulate=True)
            else:
                out.add_(_raw(row, span, dtype))
    return total


def _quantized(row: torch.Tensor, span, numel: int, dtype) -> QuantizedTensor:
    data_at, nbytes, scale_at, nscales = span
    scales = row[4 * scale_at: 4 * (scale_at + nscales)].view(torch.float32)
    return QuantizedTensor(row[data_at: data_at + nbytes], scales, GRAD_FORMAT, GRAD_BLOCK, torch.Size([numel]), dtype)


def _raw(row: torch.Tensor, span, dtype) -> torch.Tensor:
    data_at, nbytes, _, _ = span
    return row[data_at: data_at + nbytes].view(dtype)
