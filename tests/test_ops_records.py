"""Quantized records (zero_ext.ops.records over csrc/quant.h's batches) against the one-piece kernels, whose
own reference is test_ops_quantize.py: every ISA path, int8 and int4, fp32 / bf16 / fp16, odd sizes, pieces
shorter than their slot (zero padding), raw pieces, sums over records in record order, and those sums
quantized again (qgZ's second level) against unpack + pack."""
import pytest
import torch

from zero_ext import _C
from zero_ext.ops import records
from zero_ext.ops.quantize import dequantize, quant_sizes, quantize

ISAS = ["scalar", "avx2", "avx512"][: ["scalar", "avx2", "avx512"].index(_C.simd_supported()) + 1]
NUMELS = (1, 7, 512, 1029, 70001)  # 70001: above the size that splits work over threads


def _pieces(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * (1 + k)).to(dtype) for k, n in enumerate(NUMELS)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("format,block", [("int8", 2048), ("int4", 512), ("int4", 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_and_unpack_give_the_one_piece_kernels_bits(isa, format, block, dtype):
    quantized = (True, False, True, True, True)
    layout = records.Layout.of(NUMELS, quantized, format, block, dtype)
    rows = torch.zeros(2, layout.nbytes, dtype=torch.uint8)
    srcs = [_pieces(dtype, 1), _pieces(dtype, 2)]
    srcs[1][3] = srcs[1][3][:1000]  # shorter than its slot: the rest is the record's zeros
    records.pack(layout, list(rows), [[(p.data_ptr(), p.numel()) for p in row] for row in srcs], dtype, isa=isa)
    outs = [[torch.full((n,), 5.0, dtype=dtype) for n in NUMELS] for _ in range(2)]
    records.unpack(layout, list(rows), [[o.data_ptr() for o in row] for row in outs], dtype, isa=isa)
    total = torch.zeros(sum(NUMELS))
    targets = [t.data_ptr() for t in total.split(list(NUMELS))]
    records.unpack(layout, list(rows), [targets], dtype, accumulate=True, isa=isa)
    want_total = torch.zeros(sum(NUMELS))
    for row, out in zip(srcs, outs):
        for i, (src, got, q) in enumerate(zip(row, out, quantized)):
            full = torch.zeros(NUMELS[i], dtype=dtype)
            full[: src.numel()] = src
            if q:
                qt = quantize(full, format, block, isa="scalar")
                want = dequantize(qt, isa="scalar")
                acc = torch.zeros(NUMELS[i])
                dequantize(qt, out=acc, accumulate=True, isa="scalar")
            else:
                want, acc = full, full.float()
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (i, q)
            want_total[sum(NUMELS[:i]): sum(NUMELS[: i + 1])] += acc
    assert torch.equal(total, want_total)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("format,block", [("int4", 512), ("int8", 2048), ("int4", 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_requantize_gives_the_bits_of_unpack_then_pack(isa, format, block, dtype, group):
    quantized = (True, False, True, True, True)
    layout = records.Layout.of(NUMELS, quantized, format, block, dtype)
    wide = records.Layout.of(NUMELS, quantized, format, block, torch.float32)
    groups = []
    for g in range(2):  # two outputs, each the sum of `group` records
        rows = torch.zeros(group, layout.nbytes, dtype=torch.uint8)
        srcs = [_pieces(dtype, 10 * g + m) for m in range(group)]
        records.pack(layout, list(rows), [[(p.data_ptr(), p.numel()) for p in row] for row in srcs], dtype)
        groups.append(list(rows))
    got = torch.full((2, wide.nbytes), 0xAB, dtype=torch.uint8)  # garbage: every byte read back is written
    records.requantize(layout, groups, wide, list(got), dtype, isa=isa)
    want = torch.full((2, wide.nbytes), 0xAB, dtype=torch.uint8)
    for rows, out in zip(groups, want):
        total = torch.zeros(sum(NUMELS))
        parts = list(total.split(list(NUMELS)))
        records.unpack(layout, rows, [[t.data_ptr() for t in parts]], dtype, accumulate=True, isa="scalar")
        out.zero_()  # pack's contract: the record starts as zeros
        records.pack(wide, [out], [[(t.data_ptr(), t.numel()) for t in parts]], torch.float32, isa="scalar")
    for g in range(2):
        for (data_at, scales_at), q, n in zip(wide.spans, quantized, NUMELS):
            nbytes = quant_sizes(format, n, block)[0] if q else 4 * n
            assert torch.equal(got[g, data_at: data_at + nbytes], want[g, data_at: data_at + nbytes])
            if q:
                nscales = quant_sizes(format, n, block)[1]
                assert torch.equal(got[g, scales_at: scales_at + 4 * nscales], want[g, scales_at: scales_at + 4 * nscales])


def test_bad_items_are_refused():
    x = torch.zeros(8)
    with pytest.raises(ValueError):  # int4 with an odd block
        _C.quantize_batch([x.data_ptr(), x.data_ptr(), x.data_ptr(), 8, 1, 0], 3, -1)
    with pytest.raises(ValueError, match="6 integers"):
        _C.quantize_batch([1, 2, 3], 4, -1)
    with pytest.raises(ValueError):  # an accumulating group whose items do not share their target
        _C.dequantize_batch([x.data_ptr(), x.data_ptr(), 0, 8, 2, 0, x.data_ptr(), x.data_ptr() + 4, 0, 8, 2, 0],
                            2, 4, True, -1)
    with pytest.raises(ValueError):  # requantize: an input longer than its output
        _C.requantize_batch([x.data_ptr(), 0, x.data_ptr(), 8, 0, 0], 1, [0, x.data_ptr(), x.data_ptr(), 6, 0, 0], 4, -1)
    with pytest.raises(ValueError):  # requantize: a raw output that is not fp32
        _C.requantize_batch([x.data_ptr(), 0, 0, 8, 2, 0], 1, [0, x.data_ptr(), 0, 8, 2, 2], 4, -1)
    wide = records.Layout.of((100,), (True,), "int4", 64, torch.float32)
    with pytest.raises(ValueError, match="same pieces"):
        records.requantize(records.Layout.of((99,), (True,), "int4", 64, torch.float32), [[]], wide, [x], torch.float32)
    layout = records.Layout.of((100,), (True,), "int8", 64, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        records.pack(layout, [torch.zeros(10, dtype=torch.uint8)], [[(x.data_ptr(), 8)]], torch.float32)
