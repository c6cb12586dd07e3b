"""Block quantization in C (csrc/quant.c, zero_ext.ops.quantize): every ISA path against a reference
written here with torch operations, bit for bit; the stated error bound; non-finite and zero blocks;
fp32 accumulation; argument errors."""
import pytest
import torch

from helpers.quant_ref import reference
from zero_ext.ops.functional import available_isas, set_num_threads
from zero_ext.ops.quantize import QuantizedTensor, dequantize, error_bound, quant_sizes, quantize

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def packed(q, format):
    """The reference integers in the wire layout: int8 bytes, or int4 nibbles (element 2k low)."""
    if format == "int8":
        return q.to(torch.int8).view(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return ((q[0::2] & 0xF) | ((q[1::2] & 0xF) << 4)).to(torch.uint8)


def sample(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many decades, so blocks have very different scales
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    return x.to(dtype)


# (format, dtype, n, block): sizes straddle the 8/16-lane steps, blocks not multiples of them, one
# buffer past the single-thread limit (65536) so the pool splits it
CASES = [
    ("int8", torch.float32, 0, 64), ("int8", torch.float32, 1, 1), ("int8", torch.bfloat16, 17, 3),
    ("int8", torch.float16, 1000, 100), ("int8", torch.float32, 70001, 256), ("int8", torch.bfloat16, 4099, 4096),
    ("int4", torch.float32, 1, 2), ("int4", torch.float16, 33, 2), ("int4", torch.float32, 1001, 14),
    ("int4", torch.bfloat16, 70003, 2048), ("int4", torch.float16, 255, 4096), ("int4", torch.float32, 4096, 32),
]


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("format,dtype,n,block", CASES)
def test_quantize_matches_reference(isa, format, dtype, n, block):
    x = sample(n, dtype, seed=n + block)
    qt = quantize(x, format, block, isa=isa)
    q, scales = reference(x, format, block)
    assert (qt.data.numel(), qt.scales.numel()) == quant_sizes(format, n, block)
    assert torch.equal(qt.scales, scales)
    assert torch.equal(qt.data, packed(q, format))
    for out_dtype in DTYPES:
        y = dequantize(qt, dtype=out_dtype, isa=isa)
        assert y.dtype == out_dtype and y.shape == x.shape
        expect = (q.float() * scales.repeat_interleave(block)[:n]).to(out_dtype)
        assert torch.equal(y, expect), out_dtype


@pytest.mark.parametrize("format", ["int8", "int4"])
def test_error_bound_holds_and_is_tight(format):
    x = torch.cat([sample(9000, torch.float32, 1), torch.full((100,), 3.0), torch.tensor([1e-38, -2e-39, 1e30])])
    qt = quantize(x, format, 50)
    err = (dequantize(qt) - x).abs()
    bound = error_bound(x, qt)
    assert (err <= bound).all()
    # the bound is the format's: the worst error reaches most of s/2 somewhere
    assert (err / bound).max() > 0.9
    s = qt.scales.repeat_interleave(50)[: x.numel()]
    assert (err <= s / 2 * (1 + 2 ** -20) + 2 ** -21 * x.abs()).all()


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("format", ["int8", "int4"])
def test_nonfinite_block_dequantizes_to_nan_and_zero_block_to_zero(isa, format):
    x = sample(96, torch.float32, 3)
    x[40] = float("inf")
    x[70] = float("nan")
    x[0:32] = 0.0
    qt = quantize(x, format, 32, isa=isa)  # blocks: zeros, inf, nan
    assert qt.scales[0] == 0 and qt.scales[1:].isnan().all()
    y = dequantize(qt, isa=isa)
    assert torch.equal(y[:32], torch.zeros(32)) and y[32:].isnan().all()
    bf = dequantize(qt, dtype=torch.bfloat16, isa=isa)
    assert bf[32:].isnan().all()


@pytest.mark.parametrize("isa", available_isas())
def test_accumulate_adds_in_fp32(isa):
    pieces = [sample(5000, torch.bfloat16, k) for k in range(3)]
    acc = torch.full((5000,), 0.25)
    expect = acc.clone()
    for p in pieces:
        qt = quantize(p, "int4", 128, isa=isa)
        expect += dequantize(qt, dtype=torch.float32, isa=isa)
        dequantize(qt, out=acc, accumulate=True, isa=isa)
    assert torch.equal(acc, expect)


def test_threads_do_not_change_the_result():
    x = sample(300000, torch.float32, 7)
    try:
        set_num_threads(1)
        one = quantize(x, "int8", 1000)
        set_num_threads(2)
        two = quantize(x, "int8", 1000)
        y1, y2 = dequantize(one), dequantize(two)
    finally:
        set_num_threads(None)
    assert torch.equal(one.data, two.data) and torch.equal(one.scales, two.scales) and torch.equal(y1, y2)


def test_into_a_given_buffer_and_shape_kept():
    x = sample(600, torch.float16, 9).view(20, 30)
    nbytes, nblocks = quant_sizes("int4", 600, 64)
    out = QuantizedTensor(torch.empty(nbytes, dtype=torch.uint8), torch.empty(nblocks), "int4", 64, None, None)
    assert quantize(x, "int4", 64, out=out) is out
    assert out.shape == x.shape and out.dtype == torch.float16
    assert out.nbytes() == nbytes + 4 * nblocks
    assert dequantize(out).shape == (20, 30)


def test_bad_arguments_are_named():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="block must be even"):
        quantize(x, "int4", 3)
    with pytest.raises(ValueError, match="unknown quantization format 'int2'"):
        quantize(x, "int2", 4)
    with pytest.raises(ValueError, match="positive int"):
        quantize(x, "int8", 0)
    with pytest.raises(TypeError, match="dtype torch.float64"):
        quantize(x.double(), "int8", 4)
    with pytest.raises(ValueError, match="not contiguous"):
        quantize(torch.randn(10, 10).t(), "int8", 4)
    qt = quantize(x, "int8", 4)
    with pytest.raises(TypeError, match="accumulates in fp32"):
        dequantize(qt, out=torch.zeros(10, dtype=torch.bfloat16), accumulate=True)
    with pytest.raises(ValueError, match="pass an fp32 out"):
        dequantize(qt, accumulate=True)
    with pytest.raises(ValueError, match="out has 9 elements"):
        dequantize(qt, out=torch.zeros(9))
    short = QuantizedTensor(qt.data[:5], qt.scales, "int8", 4, qt.shape, qt.dtype)
    with pytest.raises(ValueError, match="5 bytes and 3 scales; 10 and 3 are needed"):
        dequantize(short)


@pytest.mark.gpu
@pytest.mark.parametrize("format,dtype,n,block", CASES)
def test_cuda_kernels_give_the_c_cores_integers_and_scales(format, dtype, n, block):
    x = sample(n, dtype, seed=n + block)
    x[n // 2:n // 2 + 1] = float("inf") if n > 2 else x[n // 2:n // 2 + 1]
    cpu = quantize(x, format, block)
    gpu = quantize(x.cuda(), format, block)
    assert torch.equal(gpu.data.cpu(), cpu.data)
    assert torch.equal(gpu.scales.cpu().nan_to_num(-1.0), cpu.scales.nan_to_num(-1.0))
    for out_dtype in DTYPES:
        y, expect = dequantize(gpu, dtype=out_dtype).cpu(), dequantize(cpu, dtype=out_dtype)
        assert torch.equal(y.isnan(), expect.isnan()) and torch.equal(y.nan_to_num(0.0), expect.nan_to_num(0.0))
    acc = torch.randn(n, device="cuda")
    expect = acc.cpu() + dequantize(cpu, dtype=torch.float32)
    dequantize(gpu, out=acc, accumulate=True)
    assert torch.equal(acc.cpu().nan_to_num(0.0), expect.nan_to_num(0.0))
