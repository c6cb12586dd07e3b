"""Quantized records (zero_ext.ops.records over csrc/quant.h's batches) against the one-piece kernels, whose
own reference is test_ops_quantize.py: every ISA path, int8 and int4, fp32 / bf16 / fp16, odd sizes, pieces
shorter than their slot (zero padding), raw pieces, and sums over records in record order."""
import pytest
import torch

from zero_ext import _C
from zero_ext.ops import records
from zero_ext.ops.quantize import dequantize, quantize

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


def test_bad_items_are_refused():
    x = torch.zeros(8)
    with pytest.raises(ValueError):  # int4 with an odd block
        _C.quantize_batch([x.data_ptr(), x.data_ptr(), x.data_ptr(), 8, 1, 0], 3, -1)
    with pytest.raises(ValueError, match="6 integers"):
        _C.quantize_batch([1, 2, 3], 4, -1)
    with pytest.raises(ValueError):  # an accumulating group whose items do not share their target
        _C.dequantize_batch([x.data_ptr(), x.data_ptr(), 0, 8, 2, 0, x.data_ptr(), x.data_ptr() + 4, 0, 8, 2, 0],
                            2, 4, True, -1)
    layout = records.Layout.of((100,), (True,), "int8", 64, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        records.pack(layout, [torch.zeros(10, dtype=torch.uint8)], [[(x.data_ptr(), 8)]], torch.float32)
