"""``checkpoint(function, *args)``: DeepSpeed's activation checkpoint, built over torch's reentrant
``torch.utils.checkpoint.checkpoint`` (the same RNG and autocast handling, so the same numbers), with
the settings of ``configure`` applied to the inputs it keeps (saved.py), the accelerator synchronised at
the call's boundaries and its times logged (``synchronize_checkpoint_boundary``, ``profile``).
"""
import logging
import time
import warnings

import torch
import torch.utils.checkpoint as torch_checkpoint

from .. import comm
from ..accelerator import get_accelerator
from . import saved, settings

logger = logging.getLogger("zero_ext.checkpointing")


def _with_keywords(function, args, kwargs):
    """Keyword arguments become positional ones (torch's reentrant checkpoint takes none), so tensors
    passed by keyword are saved and get gradients like the others."""
    if not kwargs:
        return function, args
    count, keys = len(args), tuple(kwargs)

    def call(*all_args):
        return function(*all_args[:count], **dict(zip(keys, all_args[count:])))
    return call, tuple(args) + tuple(kwargs.values())


def checkpoint(function, *args, **kwargs):
    """Runs ``function(*args, **kwargs)`` without keeping its intermediate activations; backward runs it
    again. Only the inputs are kept, as ``deepspeed.checkpointing.configure`` says (partitioned over the
    model-parallel group, in host memory, in contiguous buffers). Under no_grad nothing is kept: the
    function just runs."""
    function, args = _with_keywords(function, args, kwargs)
    if not torch.is_grad_enabled():
        return function(*args)
    s = settings.current()
    if s.synchronize_checkpoint_boundary:
        get_accelerator().synchronize()
    start = time.perf_counter()
    if s.keeps_copies:
        with torch.autograd.graph.saved_tensors_hooks(saved.packer(s), saved.unpack):
            outputs = torch_checkpoint.checkpoint(function, *args, use_reentrant=True, preserve_rng_state=True)
    else:
        outputs = torch_checkpoint.checkpoint(function, *args, use_reentrant=True, preserve_rng_state=True)
    if s.synchronize_checkpoint_boundary:
        get_accelerator().synchronize()
    if s.profile:
        _log_time("forward", time.perf_counter() - start)
    if s.synchronize_checkpoint_boundary or s.profile or s.contiguous_memory_optimization:
        _hook_backward(outputs, s)
    return outputs


def _hook_backward(outputs, s) -> None:
    """Hooks on the call's backward node (every differentiable output has the same one): before it, the
    contiguous buffers are dropped (DeepSpeed frees them when backward starts; the kept partitions hold
    their own) and the accelerator synchronised; after it, synchronised again and the time logged."""
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    node = next((o.grad_fn for o in outs if torch.is_tensor(o) and o.grad_fn is not None), None)
    if node is None:
        return
    began = []

    def before(grad_outputs):
        if s.contiguous_memory_optimization:
            saved.buffers.drop()
        if s.synchronize_checkpoint_boundary:
            get_accelerator().synchronize()
        began.append(time.perf_counter())

    def after(grad_inputs, grad_outputs):
        if s.synchronize_checkpoint_boundary:
            get_accelerator().synchronize()
        if s.profile and began:
            _log_time("backward", time.perf_counter() - began.pop())

    node.register_prehook(before)
    node.register_hook(after)


def _log_time(phase: str, seconds: float) -> None:
    if not comm.is_initialized() or comm.get_rank() == 0:  # as DeepSpeed's timers log: rank 0
        logger.info("activation checkpointing time (ms) | %s: %.2f", phase, seconds * 1e3)


_warned = []  # non_reentrant_checkpoint's warning was given


def non_reentrant_checkpoint(function, *args, **kwargs):
    """DeepSpeed's non-reentrant variant: torch's non-reentrant checkpoint (gradients flow even when no
    input requires them). It keeps the inputs as they are: partition_activations / cpu_checkpointing
    apply to ``checkpoint`` only (a warning says so once)."""
    s = settings.current()
    if s.keeps_copies and not _warned:
        _warned.append(True)
        warnings.warn("deepspeed.checkpointing.non_reentrant_checkpoint keeps its inputs whole and where they are: "
                      "partition_activations and cpu_checkpointing apply to deepspeed.checkpointing.checkpoint",
                      stacklevel=2)
    function, args = _with_keywords(function, args, kwargs)
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)


def reset() -> None:
    """Drops the contiguous buffers (DeepSpeed's ``reset``: call it after forwards without a backward,
    e.g. evaluation, so that the next forward starts at the buffers' first slot)."""
    saved.buffers.drop()
