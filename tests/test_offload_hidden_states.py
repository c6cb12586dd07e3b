"""CheckpointHiddenStatesOffload (zero_ext/activation_checkpointing/offload_hidden_states.py): what is
marked, skipped, offloaded and restored; gradients equal to checkpointing without it; the wrapper of
transformers' GradientCheckpointingLayer comes and goes with the managers. The copies themselves need a
device (host tensors are never offloaded): the gpu-marked test runs them (benchmarks/gpu_suite.sh)."""
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero_ext.activation_checkpointing import CheckpointHiddenStatesOffload


def _chain(layers, x, manager=None):
    h = x
    for layer in layers:
        if manager is not None:
            manager.mark(h)
        h = checkpoint(layer, h, use_reentrant=False)
    return h.square().sum()


def _grads(layers, x, manager=None):
    layers.zero_grad(set_to_none=True)
    x.grad = None
    if manager is None:
        _chain(layers, x).backward()
    else:
        with manager:
            _chain(layers, x, manager).backward()
    return [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]


def test_host_tensors_are_marked_but_not_offloaded_and_gradients_are_unchanged():
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    x = torch.randn(4, 8, requires_grad=True)
    want = _grads(layers, x)
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    got = _grads(layers, x, offload)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    s = offload.stats
    assert (s.marked_tensors, s.skipped_marked_tensors, s.offloaded_tensors, s.restored_tensors) == (3, 3, 0, 0)
    assert s.saved_tensors_seen > 3  # (the layers' own saved tensors pass through untouched)


def test_unmarked_and_unsaved_marks_are_left_alone():
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0)
    h = torch.randn(2, 3, requires_grad=True)
    with offload:
        offload.mark(torch.randn(5))  # never saved by autograd
        nn.Linear(3, 3)(h).sum().backward()
    assert offload.stats.skipped_marked_tensors == 0 and offload.stats.offloaded_tensors == 0
    assert h.grad is not None and not offload._marks  # the block's end forgets what it did not use


@pytest.mark.parametrize("name", ["keep_last_count", "max_fwd_stash_count", "max_cpu_buffer_pool_count",
                                  "min_offload_bytes"])
def test_negative_settings_are_refused(name):
    with pytest.raises(ValueError, match=f"{name} must be >= 0"):
        CheckpointHiddenStatesOffload(**{name: -1})


def test_a_manager_is_not_reentrant_but_instances_nest():
    outer, inner = CheckpointHiddenStatesOffload(), CheckpointHiddenStatesOffload()
    with outer:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            outer.__enter__()
        with inner:
            pass
    with outer:  # usable again after the block
        pass


def test_host_buffers_are_dense_pinned_through_the_accelerator_and_pooled(monkeypatch):
    from zero_ext.accelerator import get_accelerator

    accel, calls = get_accelerator(), []
    monkeypatch.setattr(accel, "pin_memory", lambda t, *a, **k: calls.append(t) or t)
    offload = CheckpointHiddenStatesOffload(use_streams=False, use_pin_memory=True, max_cpu_buffer_pool_count=1)
    strided = torch.randn(6, 8)[:, ::2]
    buf, key = offload._empty_cpu_like(strided)
    assert buf.is_contiguous() and buf.shape == strided.shape and len(calls) == 1
    assert key == offload._buffer_key(torch.randn(6, 4))  # strides do not matter
    offload._to_pool(key, buf)
    offload._to_pool(key, torch.empty(6, 4))  # over max_cpu_buffer_pool_count: not kept
    assert offload._empty_cpu_like(strided)[0] is buf and len(calls) == 1
    unpinned = CheckpointHiddenStatesOffload(use_streams=False, use_pin_memory=False)
    unpinned._empty_cpu_like(strided)
    assert len(calls) == 1


def test_gradient_checkpointing_layers_are_marked_while_a_manager_is_active():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GradientCheckpointingLayer"):
        pytest.skip("transformers < 4.52 has no GradientCheckpointingLayer")
    from transformers import GradientCheckpointingLayer

    class Layer(GradientCheckpointingLayer):
        def forward(self, hidden_states):
            return hidden_states.sin() * hidden_states

    original = GradientCheckpointingLayer.__call__
    layer = Layer().train()
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    x = torch.randn(4, 8, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with pytest.raises(ValueError, match="boom"):
        with offload:
            assert GradientCheckpointingLayer.__call__ is not original
            layer(x).sum().backward()
            raise ValueError("boom")
    assert GradientCheckpointingLayer.__call__ is original  # restored, on an exception too
    assert offload.stats.marked_tensors == 1 and offload.stats.skipped_marked_tensors == 1  # (a host tensor)
    assert x.grad is not None
    layer(x)
    assert offload.stats.marked_tensors == 1  # no manager, no marks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_streams, keep_last_count, stash", [(False, 0, 2), (True, 1, 2), (True, 2, 0)])
def test_device_hidden_states_go_to_the_host_and_back_with_the_same_gradients(use_streams, keep_last_count,
                                                                                 stash):
    torch.manual_seed(3)
    layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4)).cuda()
    x = torch.randn(16, 64, device="cuda", requires_grad=True)
    want = _grads(layers, x)
    offload = CheckpointHiddenStatesOffload(use_streams=use_streams, min_offload_bytes=0,
                                            keep_last_count=keep_last_count, max_fwd_stash_count=stash)
    got = _grads(layers, x, offload)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    s = offload.stats
    assert s.offloaded_tensors == s.restored_tensors == 4 - keep_last_count
    assert s.kept_last_tensors == keep_last_count and s.offloaded_bytes == (4 - keep_last_count) * 16 * 64 * 4
