"""``zero.generation(model)``: a ZeRO-3 model gathered whole for generation, after a memory check.

    with zero_ext.zero.generation(engine):           # or the module itself
        out = engine.module.generate(ids, synced_gpus=False)

Generation runs many small forwards (one per token). Partitioned, each gathers the parameters again;
when the whole model fits, it is much cheaper to gather it once: inside the block every parameter is
whole and the module hooks are off (see [Note: whole-model gathered] in model.py), so a forward costs
what the plain module costs and ranks may generate different numbers of tokens. Changes made inside
are discarded, as with ``GatheredParameters(model.parameters())``, which this is, plus:

- the memory check: the bytes the gather will allocate (each partitioned parameter's full storage,
  padding included) are compared, on every rank, with the budget -- ``max_bytes`` if given, else the
  free memory of the compute device (CUDA: ``torch.cuda.mem_get_info``; host: MemAvailable) -- and every
  rank raises GenerationMemoryError, naming the bytes, when any rank's would not fit. One small
  all-gather; collective, like the gather.
"""
import contextlib
import os
from typing import Optional

import torch

from . import collectives
from .gathered import GatheredParameters
from .param import zero_param_of
from .status import ZeroParamStatus


class GenerationMemoryError(RuntimeError):
    """The gathered model would not fit the memory budget of ``zero.generation``."""


def gather_bytes(params) -> int:
    """Bytes a GatheredParameters over ``params`` allocates (partitioned ones: their padded full storage)."""
    total, seen = 0, set()
    for p in params:
        zp = zero_param_of(p)
        if zp is None or id(zp) in seen or zp.status is not ZeroParamStatus.NOT_AVAILABLE:
            continue
        seen.add(id(zp))
        total += zp.world * zp.shard_numel * zp.dtype.itemsize
    return total


def free_bytes(device: torch.device) -> int:
    """Free memory where ``device``'s tensors live."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)"


def check_fits(params, max_bytes: Optional[int] = None) -> int:
    """Raise GenerationMemoryError on every rank unless gathering ``params`` fits each rank's budget;
    returns the bytes it will take. Collective over the parameters' group."""
    zps = [zp for zp in (zero_param_of(p) for p in params) if zp is not None]
    need = gather_bytes(params)
    if not zps:
        return need
    group, device = zps[0].group, zps[0].compute_device
    budget = int(max_bytes) if max_bytes is not None else free_bytes(device)
    rows = collectives.agree([need, budget], group, collectives.check_device(group, device))
    short = [(r, n, b) for r, (n, b) in enumerate(rows) if n > b]
    if short:
        where = "; ".join(f"rank {r} needs {_gib(n)}, has {_gib(b)}" for r, n, b in short)
        raise GenerationMemoryError(
            f"zero_ext ZeRO-3: the gathered model would not fit ({where}; budget: "
            f"{'max_bytes' if max_bytes is not None else 'free ' + device.type + ' memory'}). Generate "
            "partitioned instead (call the model without this block: each module gathers its own "
            "parameters, prefetched along the recorded trace), or free memory first.")
    return need


def _module_of(model) -> torch.nn.Module:
    module = getattr(model, "module", None)  # an engine (or DDP-like wrapper) holds the model in .module
    return module if isinstance(module, torch.nn.Module) else model


@contextlib.contextmanager
def generation(model, max_bytes: Optional[int] = None):
    """Gather ``model`` (a module or an engine) whole for the block, after the memory check (see the
    module docstring); yields the module. Collective: every rank enters and leaves it together."""
    module = _module_of(model)
    params = list(module.parameters())
    check_fits(params, max_bytes)
    with GatheredParameters(params):
        yield module


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """DeepSpeed's ``deepspeed.runtime.zero.unwrap_model_for_generation(engine)``: every parameter
    gathered and the ZeRO-3 hooks removed for the block (``engine.zero_optimizer.parameter_offload.forward_hooks``
    is empty inside), then put back; yields ``model`` itself. Collective, like GatheredParameters."""
    offload = getattr(getattr(model, "optimizer", None), "parameter_offload", None)
    with GatheredParameters(list(model.parameters())):
        if offload is not None:
            for handle in offload.forward_hooks + offload.backward_hooks:
                handle.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield model
        finally:
            if offload is not None:
                offload._register_deepspeed_module(offload.module)
