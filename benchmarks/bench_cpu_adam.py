"""CPU Adam throughput: zero_ext's kernels against torch, DeepSpeed and the memory-bandwidth floor.

    python benchmarks/bench_cpu_adam.py                       # 1e6, 1e7, 1e8 elements + the offloaded step
    python benchmarks/bench_cpu_adam.py --sizes 1e6 --rounds 3
    python benchmarks/bench_cpu_adam.py --ds-site /tmp/dsvenv/lib/python3.11/site-packages
    python benchmarks/bench_cpu_adam.py --sizes 1e8 --memory huge --no-param-list

Everything is measured in the same process and interleaved: each round runs every variant once (timed
after one untimed call of it, so that no variant pays for waking the machine).
The table gives each variant's best round (elements per second) and its ratios to the baselines:
the median over rounds of the ratio within a round, which load from other work on the machine
(that comes and goes between rounds) disturbs far less than the best-of column. Baselines, all
measured in the same run:
  floor    a kernel in _C that moves exactly Adam's bytes (reads p, g, m, v; writes p, m, v; plus
           the 2-byte write for the bf16 variant) with trivial arithmetic, on the same tiles and
           threads and with the same prefetch: the memory wall on data larger than the caches (an
           Adam loop, whose stores come spread between arithmetic, can end a few percent above it);
  ds       DeepSpeed's DeepSpeedCPUAdam (its AVX-512 kernel), when deepspeed can be imported (pass
           --ds-site with a venv's site-packages to use one installed there; never install it into
           the main environment);
  foreach  torch.optim.AdamW(foreach=True); fused: torch.optim.AdamW(fused=True).
The offloaded step is unscale + clip + Adam + bf16 copy of the new parameters:
  zx fused     grad_sqnorm (one read of g) then adam_step(grad_scale=1/combined, outs=[bf16]);
  ds sequence  g.norm(), g.mul_(1/combined), DeepSpeedCPUAdam.step(), bf16_p.copy_(p), i.e. what
               DeepSpeed's ZeRO-Offload step does on the flat fp32 gradient.
The parameter-list case is ~100M elements in ~240 tensors of a GPT-like model, stepped through the
optimizer classes (zero_ext: one C call for the group; DeepSpeed: one op call per tensor).
Each size runs on two kinds of memory (--memory), every variant on the same kind, its state
included (torch's and DeepSpeed's optimizer state is moved there after their first step):
  torch    torch.empty: 4 KiB pages, where a user's parameters and gradients usually live;
  huge     host_buffers.host_empty: transparent huge pages, each tensor on its own cache colour
           (offset in its page), where the engine keeps offloaded masters, gradient partitions and
           optimizer state, and CPUAdam its state. 4 KiB pages add a TLB miss every 4 KiB of each
           array, and torch's page-aligned arrays all share one colour; every memory-bound kernel
           runs faster on huge pages, torch's foreach AdamW hardly (its time goes to its
           temporaries, fresh memory each step).
"zx CPUAdam.step" is the optimizer class as a user runs it on the case's parameters and gradients,
with its own state (on huge pages whatever --memory says, as CPUAdam allocates it).
Benchmarks decide nothing: they print.
"""
import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zero_ext.offload.host_buffers import host_empty  # noqa: E402
from zero_ext.ops import functional as F  # noqa: E402
from zero_ext.ops.adam import CPUAdam  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def load_deepspeed(site):
    """DeepSpeedCPUAdam, or (None, why)."""
    if site:
        sys.path.insert(0, site)  # ahead of zero_ext's own `deepspeed` compatibility package
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/dsext")
    try:
        import logging

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        if "zeroext" in getattr(deepspeed, "__version__", ""):
            return None, ("the `deepspeed` found is zero_ext's compatibility package, not DeepSpeed: pass "
                          "--ds-site with a venv where DeepSpeed is installed")
        probe = torch.nn.Parameter(torch.zeros(16))
        probe.grad = torch.zeros(16)
        DeepSpeedCPUAdam([probe]).step()  # builds (or loads) the op
        return DeepSpeedCPUAdam, None
    except Exception as e:  # not installed, or its op does not build here
        return None, f"{type(e).__name__}: {e}"


MEMORY = {"torch": lambda shape, dtype=torch.float32: torch.empty(shape, dtype=dtype), "huge": host_empty}


def move_state(opt, empty):
    """Runs opt's first step (which allocates its state), then moves its state tensors to memory
    from empty, so that the optimizer works on the same kind of memory as the others."""
    opt.step()
    for state in opt.state.values():
        for k, t in state.items():
            if torch.is_tensor(t) and t.numel() > 1:
                state[k] = empty(t.shape, t.dtype).copy_(t)
    return opt


class Case:
    """One size: the tensors every variant shares, from empty (a MEMORY entry)."""

    def __init__(self, n, gen, empty):
        self.n, self.empty = n, empty
        self.p = empty(n).copy_(torch.randn(n, generator=gen))
        self.g = empty(n).copy_(torch.randn(n, generator=gen) * 1e-3)
        self.m = empty(n).zero_()
        self.v = empty(n).zero_()
        self.half = empty(n, torch.bfloat16)
        self.step = 0

    def param(self):
        """A Parameter of its own (a copy of p) with g's values as its gradient, on the case's memory."""
        p = torch.nn.Parameter(self.empty(self.n).copy_(self.p))
        p.grad = self.empty(self.n).copy_(self.g)
        return p

    def zx_adam(self, isa, out):
        def run():
            self.step += 1
            F.adam_step([self.p], [self.g], [self.m], [self.v], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                        weight_decay=WD, step=self.step, outs=[self.half] if out else None, isa=isa)
        return run

    def floor(self, out):
        return lambda: F.membw_adam([self.p], [self.g], [self.m], [self.v], outs=[self.half] if out else None)

    def zx_offloaded(self, max_norm=1.0, loss_scale=1.0):
        def run():
            norm = F.grad_sqnorm(self.g) ** 0.5
            combined = loss_scale * max(1.0, (norm / loss_scale + 1e-6) / max_norm)
            self.step += 1
            F.adam_step([self.p], [self.g], [self.m], [self.v], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                        weight_decay=WD, step=self.step, grad_scale=1.0 / combined, outs=[self.half])
        return run


def torch_opt(param, empty, **kw):
    return move_state(torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw), empty).step


def ds_offloaded(opt, param, half, max_norm=1e30, loss_scale=1.0):
    """DeepSpeed's sequence on the flat fp32 gradient. max_norm is huge so that the gradient keeps
    its values across rounds (clip never fires); DeepSpeed multiplies by 1/combined all the same."""
    def run():
        norm = param.grad.norm(2).item()
        combined = loss_scale * max(1.0, (norm / loss_scale + 1e-6) / max_norm)
        param.grad.mul_(1.0 / combined)
        opt.step()
        half.copy_(param.detach())
    return run


def measure(variants, n, rounds, min_elems=3e7):
    """{name: [elements/s of each round]}: every round runs each variant once, in order, after one
    untimed call of it. A variant runs back to back enough times to cover min_elems, so small sizes
    are not timed per wake-up."""
    reps = max(1, int(min_elems // max(n, 1)))
    rates = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm: state allocation, page faults, op builds
    for _ in range(rounds):
        for name, fn in variants.items():
            time.sleep(0.05)  # let other runtimes' spinning threads go to sleep
            fn()  # untimed: after the pause the first pass over memory runs cold (up to 2x slower here)
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            rates[name].append(reps * n / (time.perf_counter() - t))
    return rates


def gpt_like_sizes(d=576, layers=20, vocab=36000):
    """~100M elements in ~240 tensors: an embedding, then per layer qkv, proj, 2 MLP matrices,
    their biases and two layer norms."""
    sizes = [vocab * d, 1024 * d]
    for _ in range(layers):
        sizes += [3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d, d, d]
    return sizes + [d, d]


def bench_size(n, args, ds_cls, gen, empty):
    c = Case(n, gen, empty)
    variants = {"floor": c.floor(False), "floor+bf16": c.floor(True)}
    for isa in F.available_isas():
        if isa == "scalar" and n > args.scalar_max:
            continue
        variants[f"zx {isa}"] = c.zx_adam(isa, False)
        variants[f"zx {isa}+bf16"] = c.zx_adam(isa, True)
    zp = c.param()
    variants["zx CPUAdam.step"] = CPUAdam([zp], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step
    tp = c.param()
    variants["torch foreach"] = torch_opt(tp, empty, foreach=True)
    variants["torch fused"] = torch_opt(tp, empty, fused=True)
    if ds_cls:
        dp = c.param()
        ds_opt = move_state(ds_cls([dp], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True), empty)
        variants["ds"] = ds_opt.step
        ds_half = empty(n, torch.bfloat16)
        variants["ds offloaded step"] = ds_offloaded(ds_opt, dp, ds_half)
    variants["zx offloaded step"] = c.zx_offloaded(max_norm=1e30)
    return measure(variants, n, args.rounds)


def bench_param_list(args, ds_cls, gen):
    sizes = gpt_like_sizes()
    total = sum(sizes)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    zx = CPUAdam(params, lr=LR, weight_decay=WD)
    m = [torch.zeros(s) for s in sizes]
    v = [torch.zeros(s) for s in sizes]
    grads = [p.grad for p in params]
    data = [p.detach() for p in params]
    steps = [0]

    def per_tensor():
        steps[0] += 1
        for i in range(len(sizes)):
            F.adam_step([data[i]], [grads[i]], [m[i]], [v[i]], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                        weight_decay=WD, step=steps[0])

    variants = {
        "floor": lambda: F.membw_adam(data, grads, m, v),
        "zx CPUAdam.step (1 C call)": zx.step,
        "zx, 1 call per tensor": per_tensor,
        "torch foreach": torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True).step,
    }
    if ds_cls:
        variants["ds DeepSpeedCPUAdam.step"] = ds_cls(params, lr=LR, weight_decay=WD).step
    return len(sizes), total, measure(variants, total, args.rounds)


def ratio(rates, name, ref):
    """Median over rounds of name's speed over ref's in the same round: robust to load from other
    work that comes and goes between rounds, which the best-of column is not."""
    if ref not in rates:
        return None
    return statistics.median(a / b for a, b in zip(rates[name], rates[ref]))


def fmt_table(title, rates, ref_names):
    lines = [f"\n### {title}\n", "| variant | best Melem/s | " + " | ".join(f"vs {r}" for r in ref_names) + " |",
             "|---|---:|" + "---:|" * len(ref_names)]
    for name, rs in rates.items():
        cells = [ratio(rates, name, r) for r in ref_names]
        cells = ["-" if c is None else f"{c:.2f}" for c in cells]
        lines.append(f"| {name} | {max(rs) / 1e6:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7,1e8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scalar-max", type=float, default=1e8, help="skip the scalar path above this size")
    ap.add_argument("--ds-site", default=None, help="site-packages of a venv where deepspeed is installed")
    ap.add_argument("--memory", default="torch,huge", help="kinds of memory to run each size on: torch, huge")
    ap.add_argument("--no-param-list", action="store_true")
    args = ap.parse_args()

    ds_cls, why = load_deepspeed(args.ds_site)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, zero_ext threads "
          f"{F.get_num_threads()}, paths {F.available_isas()}, torch capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print("DeepSpeedCPUAdam: " + ("loaded" if ds_cls else f"not available ({why})"))
    gen = torch.Generator().manual_seed(0)
    for n in (int(float(s)) for s in args.sizes.split(",")):
        for memory in args.memory.split(","):
            rates = bench_size(n, args, ds_cls, gen, MEMORY[memory])
            print(fmt_table(f"{n:.0e} elements, {memory} memory", rates, ["floor", "floor+bf16", "ds", "torch foreach"]))
            for a, b in (("zx avx512", "ds"), ("zx avx512", "torch foreach"), ("zx avx512+bf16", "floor+bf16"),
                         ("zx offloaded step", "ds offloaded step")):
                r = ratio(rates, a, b) if a in rates and b in rates else None
                if r is not None:
                    print(f"{a} / {b}: {r:.2f}")
            del rates
            gc.collect()
    if not args.no_param_list:
        count, total, rates = bench_param_list(args, ds_cls, gen)
        print(fmt_table(f"parameter list: {count} tensors, {total / 1e6:.1f}M elements", rates,
                        ["floor", "ds DeepSpeedCPUAdam.step", "torch foreach"]))


if __name__ == "__main__":
    main()
