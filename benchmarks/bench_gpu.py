"""The GPU benchmark of benchmarks/gpu_suite.sh: zero_ext's CUDA kernels and its engine on one GPU, each
against a baseline measured in the same run. UNVERIFIED until a GPU machine has run it.

    ZERO_EXT_CUDA_LIB=1 python benchmarks/bench_gpu.py [--quick] [--device cpu]

1. Kernels (kernels/*.cu through libzx_cuda.so), timed with CUDA events, best of --repeat:
   - the floor: ``dst.copy_(src)`` of the same fp32 tensor (read 4 and write 4 bytes per element);
   - cast fp32 -> bf16 (``_native.cuda.cast_into``, the all-gather input of ZeRO-3's 16-bit parameters)
     against torch's ``dst.copy_(src)`` doing the same conversion; it moves 6 bytes per element, so
     its share of the floor is (6 / 8) * floor_time / time;
   - int8 and int4 block quantize / dequantize (``ops.quantize``, ZeRO++ qwZ / qgZ) against the same
     arithmetic in torch ops (absmax per block, scale, round, clamp).
2. The engine at world 1 (one process, NCCL): the demo GPT (--d / --layers), bf16, AdamW, one batch
   shape, the same random batches. Plain PyTorch (fp32 weights, bf16 autocast, fused AdamW) is the
   baseline; zero_ext runs ZeRO-1, ZeRO-3 and ZeRO-2 with offload_optimizer cpu (the C Adam on the
   host). Median step time, ratio to plain, and the GPU memory: torch's peak allocated and what
   ``engine.memory_breakdown()`` counts on the accelerator.

``--device cpu`` runs the same code on the CPU with gloo and a small model: a dry run of the script
where there is no GPU (the kernel rows are skipped). Never part of the test suite's pass/fail.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's zero_ext, and the demo's model

import zero_ext  # noqa: E402
from demo.model import GPT, count_params, lm_loss  # noqa: E402
from zero_ext._native import cuda as zx_cuda  # noqa: E402
from zero_ext.ops import quantize as zx_quant  # noqa: E402

VOCAB = 256


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="smaller tensors, model and step counts")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    return p.parse_args()


# --- 1. kernels ------------------------------------------------------------------------------------

def _best_ms(fn, repeat: int) -> float:
    """Best of `repeat` timings of fn() in ms, by CUDA events (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _torch_quantize(x: torch.Tensor, bits: int, block: int):
    """The same block quantization in torch ops: the baseline the kernel is measured against."""
    qmax = 2 ** (bits - 1) - 1
    blocks = x.float().view(-1, block)
    scales = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / qmax
    return torch.round(blocks / scales).clamp_(-qmax - 1, qmax).to(torch.int8), scales


def kernel_rows(n: int, repeat: int):
    src = torch.randn(n, device="cuda")
    dst32, dst16 = torch.empty_like(src), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    floor = _best_ms(lambda: dst32.copy_(src), repeat)
    rows = [("copy fp32 (floor)", floor, floor, 1.0)]
    if not zx_cuda.cast_into(dst16, src):
        raise SystemExit("cast_into did nothing: set ZERO_EXT_CUDA_LIB=1 and build with ZERO_EXT_CUDA=1")
    ours = _best_ms(lambda: zx_cuda.cast_into(dst16, src), repeat)
    theirs = _best_ms(lambda: dst16.copy_(src), repeat)
    rows.append(("cast fp32->bf16", ours, theirs, 0.75 * floor / ours))
    block = 256
    for fmt, bits in (("int8", 8), ("int4", 4)):
        qt = zx_quant.quantize(src, fmt, block)
        ours = _best_ms(lambda: zx_quant.quantize(src, fmt, block, out=qt), repeat)
        theirs = _best_ms(lambda: _torch_quantize(src, bits, block), repeat)
        # reads 4 bytes, writes bits/8 (+ a scale per block)
        rows.append((f"quantize {fmt}", ours, theirs, (4 + bits / 8) / 8 * floor / ours))
        out = torch.empty_like(src)
        ours = _best_ms(lambda: zx_quant.dequantize(qt, out=out), repeat)
        q, s = _torch_quantize(src, bits, block)
        theirs = _best_ms(lambda: torch.mul(q.float(), s, out=out.view(-1, block)), repeat)
        rows.append((f"dequantize {fmt}", ours, theirs, (4 + bits / 8) / 8 * floor / ours))
    return rows


# --- 2. the engine at world 1 ----------------------------------------------------------------------

ZERO_CONFIGS = {
    "z1": {"stage": 1},
    "z3": {"stage": 3},
    "z2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}


def _batches(args, device, count):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (args.batch, args.block + 1), generator=g).to(device) for _ in range(count)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed_steps(step, batches, device, warmup=2):
    times = []
    for i, b in enumerate(batches):
        _sync(device)
        t = time.perf_counter()
        step(b)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def plain_row(args, device, batches):
    torch.manual_seed(0)
    model = GPT(VOCAB, d=args.d, layers=args.layers, block=args.block).to(device)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(b):
        with autocast:
            loss = lm_loss(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    _peak_reset(device)
    median = _timed_steps(step, batches, device)
    row = ("plain torch (autocast bf16, AdamW)", median, _peak(device), None, count_params(model))
    del model, opt
    return row


def engine_row(name, args, device, batches):
    torch.manual_seed(0)
    zero = dict(ZERO_CONFIGS[name])
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}
    _peak_reset(device)
    model = GPT(VOCAB, d=args.d, layers=args.layers, block=args.block)
    engine, *_ = zero_ext.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(b):
        loss = lm_loss(engine(b[:, :-1]), b[:, 1:])
        engine.backward(loss)
        engine.step()

    median = _timed_steps(step, batches, device)
    counted = sum(v.get("accelerator", 0) for v in engine.memory_breakdown().values())
    row = (f"zero_ext {name}", median, _peak(device), counted, None)
    engine.destroy()
    return row


def main():
    args = parse_args()
    if args.device == "cpu":
        args.d, args.layers, args.batch, args.block, args.steps = 128, 2, 2, 64, 4
        backend = "gloo"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_gpu: no CUDA device (use --device cpu for a dry run)")
        backend = "nccl"
        if args.quick:
            args.layers, args.steps, args.repeat = 6, 6, 10
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
              f"ZERO_EXT_CUDA_LIB={zx_cuda.on_engine_path() and 1 or 0}")
        n = (16 if args.quick else 64) << 20
        print(f"\n1. kernels, {n >> 20}M fp32 elements, best of {args.repeat} (ms; 'of floor' = the bytes the "
              f"kernel moves over the fp32 copy's rate)")
        print(f"{'kernel':22} {'zero_ext':>9} {'torch':>9} {'x torch':>8} {'of floor':>8}")
        for name, ours, theirs, share in kernel_rows(n, args.repeat):
            print(f"{name:22} {ours:9.3f} {theirs:9.3f} {theirs / ours:8.2f} {share:8.2f}")
    dist.init_process_group(backend, rank=0, world_size=1)
    batches = _batches(args, device, args.steps)
    rows = [plain_row(args, device, batches)]
    for name in ZERO_CONFIGS:
        rows.append(engine_row(name, args, device, batches))
    base = rows[0][1]
    print(f"\n2. one step at world 1: GPT {rows[0][4] / 1e6:.0f}M parameters, batch {args.batch} x {args.block}, "
          f"median of {args.steps - 2} steps")
    print(f"{'configuration':38} {'step ms':>8} {'x plain':>8} {'peak MiB':>9} {'counted MiB':>11}")
    for name, median, peak, counted, _ in rows:
        counted_s = f"{counted / 2**20:11.0f}" if counted is not None else f"{'':11}"
        print(f"{name:38} {median * 1e3:8.1f} {median / base:8.2f} {peak / 2**20:9.0f} {counted_s}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
