"""The CPU optimizer kernels of zero_ext._C as plain functions on lists of tensors.

One call steps every tensor given (a ZeRO sub-group, or a param group's parameters) in one pass
over memory, on zero_ext's own thread pool, with the GIL released. This is what the optimizer
classes (adam.py, adagrad.py, lion.py) and the offloaded engine step call.

The offloaded step is two calls:
    sumsq = grad_sqnorm(grad_buffer, out=fp32_grad)            # norm, fused with the copy in
    adam_step([p], [fp32_grad], [m], [v], ..., grad_scale=1 / combined_scale, outs=[bf16_p])
where combined_scale is loss_scale times the clip factor computed from sumsq: the gradient is
unscaled and clipped as it is loaded, and the new parameters are written in fp32 and bf16 in the
same pass.

isa: None for the best path here (capped by ZERO_EXT_ISA), or "avx512", "avx2", "scalar" to force
one (tests and benchmarks); asking for one this CPU lacks raises ValueError.
"""
import torch

from .. import _C
from .._native.dtypes import cpu_ptr, kernel_dtype

ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}

_threads = {"explicit": None, "synced": None}


def set_num_threads(n):
    """Fixes the number of threads of the CPU optimizer kernels; None goes back to the default,
    which follows torch.get_num_threads()."""
    if n is None:
        _threads["explicit"] = _threads["synced"] = None
        _sync_threads()
        return
    n = int(n)
    if n < 1:
        raise ValueError(f"set_num_threads needs n >= 1 (or None), got {n}")
    _C.cpu_optim_set_threads(n)
    _threads["explicit"] = n


def get_num_threads():
    """Threads the CPU optimizer kernels use."""
    _sync_threads()
    return _C.cpu_optim_threads()


def _sync_threads():
    """Follows torch.get_num_threads() unless set_num_threads was called."""
    if _threads["explicit"] is not None:
        return
    n = torch.get_num_threads()
    if n != _threads["synced"]:
        _C.cpu_optim_set_threads(n)
        _threads["synced"] = n


def available_isas():
    """The paths this CPU can run, best first: a subset of ("avx512", "avx2", "scalar")."""
    best = ISA_CODES[_C.simd_supported()]
    return tuple(name for name, code in sorted(ISA_CODES.items(), key=lambda kv: -kv[1]) if code <= best)


def isa_code(isa):
    if isa is None:
        return -1
    if isa not in ISA_CODES:
        raise ValueError(f"isa must be None or one of {sorted(ISA_CODES)}, not {isa!r}")
    if ISA_CODES[isa] > ISA_CODES[_C.simd_supported()]:
        raise ValueError(f"this CPU cannot run the {isa} path; it supports {available_isas()}")
    return ISA_CODES[isa]


def _ptrs(tensors, name, numels):
    return [cpu_ptr(t, f"{name}[{i}]", numel=n) for i, (t, n) in enumerate(zip(tensors, numels))]


def _outs(outs, numels):
    """(pointers or None, dtype code) of the optional bf16/fp16 copies."""
    if outs is None:
        return None, kernel_dtype(torch.bfloat16)
    if len(outs) != len(numels):
        raise ValueError(f"outs has {len(outs)} entries for {len(numels)} tensors")
    dtypes = {o.dtype for o in outs if o is not None}
    if not dtypes:
        return None, kernel_dtype(torch.bfloat16)
    if len(dtypes) > 1 or not dtypes <= {torch.bfloat16, torch.float16}:
        raise TypeError(f"outs must all be bfloat16 or all float16, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    ptrs = [0 if o is None else cpu_ptr(o, f"outs[{i}]", dtype, n) for i, (o, n) in enumerate(zip(outs, numels))]
    return ptrs, kernel_dtype(dtype)


def _lists(params, *others):
    params = list(params)
    numels = [p.numel() if isinstance(p, torch.Tensor) else cpu_ptr(p, f"params[{i}]") for i, p in enumerate(params)]
    for name, seq in others:
        if len(seq) != len(params):
            raise ValueError(f"{name} has {len(seq)} entries for {len(params)} params")
    return params, numels


def adam_step(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
              bias_correction=True, adamw_mode=True, grad_scale=1.0, outs=None, isa=None):
    """One Adam (adamw_mode=False: L2 added to the gradient) or AdamW step, in place.

    All tensors are contiguous fp32 CPU tensors; the i-th of each list has the same numel. `step`
    is the step being taken (1 for the first). Gradients are multiplied by grad_scale as they are
    loaded and are not modified. outs: None, or one bfloat16/float16 tensor (or None) per param that
    receives the new parameters rounded to nearest even, bit for bit torch's .to().
    """
    params, numels = _lists(params, ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs))
    if int(step) < 1:
        raise ValueError(f"step counts from 1, got {step}")
    out_ptrs, out_dtype = _outs(outs, numels)
    _sync_threads()
    _C.adam_step(_ptrs(params, "params", numels), _ptrs(grads, "grads", numels),
                 _ptrs(exp_avgs, "exp_avgs", numels), _ptrs(exp_avg_sqs, "exp_avg_sqs", numels),
                 out_ptrs, numels, out_dtype, float(lr), float(beta1), float(beta2), float(eps),
                 float(weight_decay), int(step), bool(bias_correction), bool(adamw_mode),
                 float(grad_scale), isa_code(isa))


def adagrad_step(params, grads, sums, *, lr, eps, weight_decay=0.0, grad_scale=1.0, outs=None, isa=None):
    """One Adagrad step in place (torch.optim.Adagrad with lr_decay=0); sums: the sum of squares."""
    params, numels = _lists(params, ("grads", grads), ("sums", sums))
    out_ptrs, out_dtype = _outs(outs, numels)
    _sync_threads()
    _C.adagrad_step(_ptrs(params, "params", numels), _ptrs(grads, "grads", numels),
                    _ptrs(sums, "sums", numels), out_ptrs, numels, out_dtype, float(lr), float(eps),
                    float(weight_decay), float(grad_scale), isa_code(isa))


def lion_step(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay=0.0, grad_scale=1.0, outs=None,
              isa=None):
    """One Lion step in place: p = p*(1 - lr*wd) - lr*sign(lerp(m, g, 1-beta1)); m = lerp(m, g, 1-beta2)."""
    params, numels = _lists(params, ("grads", grads), ("exp_avgs", exp_avgs))
    out_ptrs, out_dtype = _outs(outs, numels)
    _sync_threads()
    _C.lion_step(_ptrs(params, "params", numels), _ptrs(grads, "grads", numels),
                 _ptrs(exp_avgs, "exp_avgs", numels), out_ptrs, numels, out_dtype, float(lr),
                 float(beta1), float(beta2), float(weight_decay), float(grad_scale), isa_code(isa))


def grad_sqnorm(grad, out=None, isa=None):
    """Sum of squares of `grad` (fp32, bf16 or fp16; summed in double), and, if `out` (fp32, same
    numel) is given, grad's fp32 copy written there in the same pass. Inf/NaN give Inf/NaN."""
    n = grad.numel()
    src = cpu_ptr(grad, "grad", grad.dtype)
    dst = 0 if out is None else cpu_ptr(out, "out", torch.float32, n)
    _sync_threads()
    return _C.grad_sqnorm(dst, src, kernel_dtype(grad.dtype), n, isa_code(isa))


def cast_(dst, src, isa=None):
    """dst (bfloat16 or float16) = src (fp32), rounded exactly as src.to(dst.dtype). Returns dst."""
    n = src.numel()
    sp = cpu_ptr(src, "src", torch.float32)
    if dst.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"cast_ writes bfloat16 or float16, not {dst.dtype}")
    dp = cpu_ptr(dst, "dst", dst.dtype, n)
    _sync_threads()
    _C.cast_f32(dp, kernel_dtype(dst.dtype), sp, n, isa_code(isa))
    return dst


def membw_adam(params, grads, exp_avgs, exp_avg_sqs, outs=None, isa=None):
    """Benchmark floor: moves exactly Adam's bytes (p, m, v += g; outs = top half of p) with the
    same tiles and threads as adam_step. Overwrites its arguments."""
    params, numels = _lists(params, ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs))
    out_ptrs, out_dtype = _outs(outs, numels)
    _sync_threads()
    _C.membw_adam(_ptrs(params, "params", numels), _ptrs(grads, "grads", numels),
                  _ptrs(exp_avgs, "exp_avgs", numels), _ptrs(exp_avg_sqs, "exp_avg_sqs", numels),
                  out_ptrs, numels, out_dtype, isa_code(isa))
