"""Host offload of the hidden states that activation checkpointing keeps until backward (DeepSpeed's
``deepspeed.runtime.activation_checkpointing.offload_activations``).

With torch's non-reentrant checkpoint, a checkpointed layer keeps only its inputs for the recomputation
in backward; across a deep model those inputs (the hidden states between layers) are what remains of
the activation memory. Inside ``with CheckpointHiddenStatesOffload():`` the tensors marked with
``mark(t)`` are copied to host memory when autograd saves them and copied back when backward needs
them. With transformers installed, the first argument of every ``GradientCheckpointingLayer`` that
checkpoints in training is marked for you (its ``__call__`` is wrapped while a manager is active).

- The newest ``keep_last_count`` marked tensors stay on the device: backward needs them first, before a
  host copy would come back. Older ones are copied out as newer ones arrive.
- Not offloaded (counted in ``stats.skipped_marked_tensors``): host tensors, tensors under
  ``min_offload_bytes``, parameters and buffers, and overlapping views (a stride of 0: the copy back
  could not write aliased storage). A marked tensor that autograd never saves is dropped at the end of
  the call that marked it.
- ``use_streams`` (CUDA): copies run on a side stream; up to ``max_fwd_stash_count`` device tensors are
  held until their copy ends, so the forward never waits. Host buffers are pinned (``use_pin_memory``,
  through the accelerator) and reused across steps, up to ``max_cpu_buffer_pool_count``.
- Backward must run inside the block: leaving it waits for the copies and forgets what was offloaded.
  A manager is not re-entrant; nest separate instances.
"""
import contextlib
import importlib.util
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch.autograd.graph import saved_tensors_hooks

from ..accelerator import get_accelerator

__all__ = ["CheckpointActivationOffloadStats", "CheckpointHiddenStatesOffload",
           "get_checkpoint_hidden_states_offloading_ctx_manager", "patch_gradient_checkpointing_layer_marker"]


@dataclass
class CheckpointActivationOffloadStats:
    saved_tensors_seen: int = 0  # every tensor autograd saved inside the block
    marked_tensors: int = 0
    skipped_marked_tensors: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    restored_tensors: int = 0
    restored_bytes: int = 0
    kept_last_tensors: int = 0  # marked tensors backward found still on the device (keep_last_count)


class _Offloaded:
    """What autograd holds instead of an offloaded tensor: the number it is tracked under."""
    __slots__ = ("tensor_id",)

    def __init__(self, tensor_id: int):
        self.tensor_id = tensor_id


def _nbytes(t: torch.Tensor) -> int:
    return t.element_size() * t.numel()


class CheckpointHiddenStatesOffload(saved_tensors_hooks):
    """The context manager described in the module docstring; ``stats`` counts what it did."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1):
        for name, value in (("keep_last_count", keep_last_count), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("min_offload_bytes", min_offload_bytes)):
            if value < 0:
                raise ValueError(f"CheckpointHiddenStatesOffload: {name} must be >= 0, got {value}")
        self.use_pin_memory, self.min_offload_bytes = use_pin_memory, min_offload_bytes
        self.max_fwd_stash_count, self.max_cpu_buffer_pool_count = max_fwd_stash_count, max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        self.use_streams = use_streams and torch.cuda.is_available()
        self._side = torch.cuda.Stream() if self.use_streams else None
        self.stats = CheckpointActivationOffloadStats()
        self._next_id = 0
        self._marks: Dict[int, tuple] = {}  # id(tensor) -> (weak reference, marks no save consumed yet)
        self._keep_last: Dict[int, torch.Tensor] = {}  # newest marked tensors, oldest first
        self._tracker: Dict[int, tuple] = {}  # tensor_id -> (host buffer, device, size, stride, pool key)
        self._fwd_stash: Dict[int, Tuple[torch.Tensor, object]] = {}  # device tensors whose copy may run
        self._restored: Dict[int, torch.Tensor] = {}  # for a second backward (retain_graph)
        self._pool: Dict[tuple, List[torch.Tensor]] = {}
        self._pending_buffers: List[tuple] = []  # (key, host buffer, event): free once the copy back ends
        super().__init__(self._pack, self._unpack)

    # -- marking -----------------------------------------------------------------------------------------

    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` when autograd next saves it inside this block."""
        ref, count = self._marks.get(id(tensor), (None, 0))
        if ref is None or ref() is not tensor:  # (an id of a tensor gone since is reused by a new one)
            ref, count = weakref.ref(tensor), 0
        self._marks[id(tensor)] = (ref, count + 1)
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        ref, count = self._marks.get(id(tensor), (None, 0))
        if ref is None or ref() is not tensor:
            return False
        if count == 1:
            del self._marks[id(tensor)]
        else:
            self._marks[id(tensor)] = (ref, count - 1)
        return True

    # -- autograd's saved-tensor hooks -------------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor):
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        if self._skipped(tensor):
            self.stats.skipped_marked_tensors += 1
            return tensor
        self._next_id += 1
        self._keep_last[self._next_id] = tensor
        while len(self._keep_last) > self.keep_last_count:  # the oldest kept one goes out now
            oldest = next(iter(self._keep_last))
            self._offload(oldest, self._keep_last.pop(oldest))
        return _Offloaded(self._next_id)

    def _unpack(self, packed):
        return self._restore(packed.tensor_id) if isinstance(packed, _Offloaded) else packed

    def _skipped(self, t: torch.Tensor) -> bool:
        return (t.device.type == "cpu" or _nbytes(t) < self.min_offload_bytes
                or isinstance(t, torch.nn.Parameter) or isinstance(t, getattr(torch.nn, "Buffer", ()))
                or (t.numel() > 1 and 0 in t.stride()))

    # -- copies ------------------------------------------------------------------------------------------

    def _buffer_key(self, t: torch.Tensor) -> tuple:
        """Host buffers are dense: tensors that differ only in strides share a pool entry."""
        return tuple(t.size()), t.dtype, t.layout, self.use_pin_memory

    def _empty_cpu_like(self, t: torch.Tensor) -> Tuple[torch.Tensor, tuple]:
        self._free_pending(wait=False)
        key = self._buffer_key(t)
        if self._pool.get(key):
            return self._pool[key].pop(), key
        host = torch.empty(tuple(t.size()), dtype=t.dtype, layout=t.layout, device="cpu")
        return (get_accelerator().pin_memory(host) if self.use_pin_memory else host), key

    def _to_pool(self, key: tuple, host: torch.Tensor) -> None:
        if sum(len(v) for v in self._pool.values()) < self.max_cpu_buffer_pool_count:
            self._pool.setdefault(key, []).append(host)

    def _free_pending(self, wait: bool) -> None:
        still = []
        for key, host, event in self._pending_buffers:
            if wait or event.query():
                event.synchronize()
                self._to_pool(key, host)
            else:
                still.append((key, host, event))
        self._pending_buffers = still

    def _stream(self):
        return torch.cuda.stream(self._side) if self.use_streams else contextlib.nullcontext()

    def _offload(self, tensor_id: int, t: torch.Tensor) -> None:
        if self.use_streams:
            for old in [i for i in self._fwd_stash if i <= self._next_id - self.max_fwd_stash_count]:
                del self._fwd_stash[old]  # (record_stream keeps the memory until the side stream is past it)
            self._side.wait_stream(torch.cuda.current_stream(t.device))
        with self._stream():
            host, key = self._empty_cpu_like(t)
            host.copy_(t.detach(), non_blocking=self.use_streams)
        self._tracker[tensor_id] = (host, t.device, t.size(), t.stride(), key)
        if self.use_streams:
            t.record_stream(self._side)
            if self.max_fwd_stash_count > 0:
                self._fwd_stash[tensor_id] = (t, self._side.record_event())
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += _nbytes(host)

    def _restore(self, tensor_id: int) -> torch.Tensor:
        if tensor_id in self._restored:
            return self._restored[tensor_id]
        if tensor_id in self._keep_last:
            t = self._restored[tensor_id] = self._keep_last.pop(tensor_id)
            self.stats.kept_last_tensors += 1
            return t
        tracked = self._tracker.pop(tensor_id, None)
        if tracked is None:
            raise RuntimeError(f"CheckpointHiddenStatesOffload: offloaded activation {tensor_id} is gone: run "
                               "backward inside the `with` block that ran the forward (leaving it drops them)")
        host, device, size, stride, key = tracked
        if tensor_id in self._fwd_stash:  # still on the device: no copy back needed
            t, event = self._fwd_stash.pop(tensor_id)
            torch.cuda.current_stream(device).wait_event(event)
            self._to_pool(key, host)
        else:
            with self._stream():
                t = torch.empty_strided(size, stride, dtype=host.dtype, device=device)
                t.copy_(host, non_blocking=self.use_streams)
            if self.use_streams:
                compute = torch.cuda.current_stream(device)
                event = self._side.record_event()
                compute.wait_event(event)
                t.record_stream(compute)
                self._pending_buffers.append((key, host, event))
            else:
                self._to_pool(key, host)
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += _nbytes(t)
        self._restored[tensor_id] = t
        return t

    # -- the block ---------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Waits for the copies in flight, then forgets every tensor and the counts."""
        if self.use_streams:
            self._side.synchronize()
            self._free_pending(wait=True)
        self.stats = CheckpointActivationOffloadStats()
        for table in (self._marks, self._keep_last, self._tracker, self._fwd_stash, self._restored):
            table.clear()

    def __enter__(self):
        stack = _managers()
        if self in stack:
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant: nest a separate instance")
        _marker_users(+1)
        self.reset()
        stack.append(self)
        try:
            return super().__enter__()
        except BaseException:
            stack.remove(self)
            _marker_users(-1)
            raise

    def __exit__(self, *exc):
        try:
            if self.use_streams:
                self._side.synchronize()
                self._free_pending(wait=True)
            for table in (self._marks, self._keep_last, self._tracker, self._fwd_stash, self._restored):
                table.clear()
        finally:
            try:
                _managers().remove(self)
                _marker_users(-1)
            finally:
                super().__exit__(*exc)


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """DeepSpeed's factory of the manager (same arguments)."""
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes,
                                         max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)


# -- transformers' GradientCheckpointingLayer: marks its hidden_states while a manager is active ----------

_local = threading.local()
_lock = threading.Lock()
_patch = {"users": 0, "original": None, "installed": None, "by_context": False}


def _managers() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def patch_gradient_checkpointing_layer_marker() -> None:
    """Wraps ``transformers.GradientCheckpointingLayer.__call__`` so that, in training with gradient
    checkpointing on, its first argument (the hidden states it checkpoints) is marked for the innermost
    active manager. Called by the first manager entered when transformers is installed; call it yourself
    to keep the wrapper for the whole process."""
    with _lock:
        _install()
        _patch["by_context"] = False


def _install() -> None:
    if _patch["installed"] is not None:
        return
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError as exc:
        raise RuntimeError("patch_gradient_checkpointing_layer_marker needs transformers >= 4.52 (the release "
                           "with GradientCheckpointingLayer): pip install -U transformers") from exc
    original = GradientCheckpointingLayer.__call__

    def call_marking_hidden_states(self, *args, **kwargs):
        stack = _managers()
        marked = None
        if stack and self.training and torch.is_grad_enabled() and getattr(self, "gradient_checkpointing", False):
            if args and torch.is_tensor(args[0]):  # (a keyword hidden_states is not what checkpoint saves)
                marked = args[0]
                stack[-1].mark(marked)
        try:
            return original(self, *args, **kwargs)
        finally:
            if marked is not None:  # a mark no save consumed must not outlive the call (ids are reused)
                stack[-1]._consume_mark(marked)

    _patch["original"] = GradientCheckpointingLayer.__dict__.get("__call__")  # None: inherited
    GradientCheckpointingLayer.__call__ = call_marking_hidden_states
    _patch["installed"], _patch["by_context"] = call_marking_hidden_states, True


def _uninstall() -> None:
    from transformers import GradientCheckpointingLayer

    if GradientCheckpointingLayer.__dict__.get("__call__") is _patch["installed"]:
        if _patch["original"] is None:
            del GradientCheckpointingLayer.__call__
        else:
            GradientCheckpointingLayer.__call__ = _patch["original"]
    _patch.update(installed=None, original=None, by_context=False)


def _marker_users(delta: int) -> None:
    """Managers entered count as users of the wrapper; the one installed by them goes with the last."""
    with _lock:
        if delta > 0 and _patch["installed"] is None and importlib.util.find_spec("transformers") is not None:
            _install()
        if _patch["installed"] is None:
            return
        _patch["users"] = max(0, _patch["users"] + delta)
        if _patch["users"] == 0 and _patch["by_context"]:
            _uninstall()
