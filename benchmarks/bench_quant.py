"""Block quantization (zero_ext.ops.quantize, csrc/quant.c) against the same format written with torch
operations and against a memcpy floor, one process, measured in the same run.

    python benchmarks/bench_quant.py [--sizes 1e6,1e7,1e8] [--threads 1] [--repeat 5] [--block 2048]

Rows: format (int8 / int4) x input dtype x size x direction (quantize, dequantize to the input's dtype),
each ISA path of the C kernel. Columns: the C kernel's time (best of `repeat`), torch's time for the same
result (per-block amax, divide, round, clamp, pack), and the floor: torch copying as many bytes as the
kernel reads plus writes, halved (a copy reads and writes each byte), i.e. the least time any kernel
moving those bytes can take. Ratios: torch / C (times faster) and floor / C (fraction of memory speed).
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from zero_ext.ops.functional import available_isas, set_num_threads  # noqa: E402
from zero_ext.ops.quantize import LEVELS, dequantize, quantize  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def best(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def torch_quantize(x, format, block):
    """The format with torch operations (what a user without the kernel writes)."""
    n, L = x.numel(), LEVELS[format]
    pad = (-n) % block
    xf = torch.nn.functional.pad(x.float().flatten(), (0, pad)).view(-1, block)
    amax = xf.abs().amax(dim=1, keepdim=True)
    scales = amax / L
    q = torch.round(xf * (L / amax).nan_to_num(0.0, 0.0, 0.0)).clamp_(-L, L).to(torch.int8).flatten()[:n]
    if format == "int4":
        q = torch.nn.functional.pad(q, (0, n % 2)).view(-1, 2)
        q = ((q[:, 0] & 0xF) | ((q[:, 1] & 0xF) << 4)).to(torch.uint8)
    return q, scales


def torch_dequantize(q, scales, format, block, n, dtype):
    if format == "int4":
        q = torch.stack([(q.to(torch.int16) & 0xF), (q.to(torch.int16) >> 4)], dim=1).flatten()[:n]
        q = ((q ^ 8) - 8).to(torch.int8)
    pad = (-n) % block
    v = torch.nn.functional.pad(q.float(), (0, pad)).view(-1, block) * scales
    return v.flatten()[:n].to(dtype)


def floor_time(nbytes, repeat):
    half = max(1, nbytes // 2)
    a, b = torch.ones(half, dtype=torch.uint8), torch.empty(half, dtype=torch.uint8)
    return best(lambda: b.copy_(a), repeat)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e6,1e7,1e8")
    ap.add_argument("--threads", type=int, default=1, help="threads of the C kernel and of torch")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--dtypes", default="fp32,bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    set_num_threads(args.threads)
    print(f"# threads {args.threads}, block {args.block}, best of {args.repeat}; load {os.getloadavg()[0]:.1f}")
    print(f"{'format':6} {'dtype':5} {'size':>6} {'op':10} {'isa':7} {'C ms':>8} {'torch ms':>9} "
          f"{'floor ms':>9} {'torch/C':>8} {'floor/C':>8}")
    for size in (int(float(s)) for s in args.sizes.split(",")):
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            x = (torch.randn(size) * 3).to(dtype)
            for format in ("int8", "int4"):
                qt = quantize(x, format, args.block)
                wire = qt.nbytes()
                moved = x.numel() * x.element_size() + wire
                floor = floor_time(moved, args.repeat)
                tq = best(lambda: torch_quantize(x, format, args.block), args.repeat)
                q_t, s_t = torch_quantize(x, format, args.block)
                td = best(lambda: torch_dequantize(q_t, s_t, format, args.block, size, dtype), args.repeat)
                out = torch.empty_like(x)
                for isa in available_isas():
                    cq = best(lambda: quantize(x, format, args.block, out=qt, isa=isa), args.repeat)
                    cd = best(lambda: dequantize(qt, out=out, isa=isa), args.repeat)
                    for op, c, t in (("quantize", cq, tq), ("dequantize", cd, td)):
                        print(f"{format:6} {dname:5} {size:6.0e} {op:10} {isa:7} {c * 1e3:8.3f} {t * 1e3:9.3f} "
                              f"{floor * 1e3:9.3f} {t / c:8.1f} {floor / c:8.2f}")


if __name__ == "__main__":
    main()
