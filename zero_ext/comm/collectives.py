"""The collective facade: every collective zero_ext runs goes through these names, so there is one
place that decides how ranks talk. Each has torch.distributed's signature and semantics (a Work back
when ``async_op``), and they are DeepSpeed's ``deepspeed.comm`` names too.

The transport is chosen per call, the same way on every rank: CPU tensors of a group whose ranks share
this host go through the native shared-memory communicator (native.py, csrc/comm.h); contiguous CUDA
tensors of one device through zero_ext's NCCL communicator (nccl.py, csrc/comm_nccl.c; unverified on
a GPU) where the CUDA library was built; everything else (ranks on several hosts with CPU tensors,
``ZERO_EXT_COMM=torch``, reductions or dtypes a transport lacks, the verbs the NCCL transport does not
carry: reduce, scatter, all_to_all_single and the list forms) through torch.distributed's backends
(gloo, NCCL). Object collectives and point-to-point stay torch.distributed's.
"""
import types

import torch
import torch.distributed as dist

from . import native as _native
from . import nccl as _nccl
from . import traffic
from .outstanding import tracked, tracked_objects

# torch.distributed's collectives, each through outstanding.run: the backend gets aliases of the
# tensors, kept until its threads let go ([Note: the exit race] in outstanding.py). The facade's verbs
# fall back on these; the rest are only these.
_torch = types.SimpleNamespace(**{name: tracked(getattr(dist, name)) for name in (
    "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
    "broadcast", "scatter", "barrier")})
ReduceOp = dist.ReduceOp
gather = tracked(dist.gather)
_all_to_all_single = tracked(dist.all_to_all_single)
send, recv, isend, irecv = tracked(dist.send), tracked(dist.recv), tracked(dist.isend), tracked(dist.irecv)
gather_object = tracked_objects(dist.gather_object)
all_gather_object = tracked_objects(dist.all_gather_object)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    """Chunk d of ``input`` (dim 0, split evenly or by ``input_split_sizes``) to rank d; rank s's chunk
    into chunk s of ``output``. Natively one op (uneven splits: after a small all-gather of the sizes)."""
    traffic.count("all_to_all", "scatter", group, _nbytes(input))
    native = _route_cpu(group, output, input)
    if native is not None:
        return native.all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)
    return _all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _on_cpu(*tensors) -> bool:
    return all(t.device.type == "cpu" and not t.is_sparse for t in tensors)


def _route(group, *tensors):
    """The communicator for these tensors on this group: native shared memory (CPU), NCCL (CUDA, one
    device, contiguous), or None for torch.distributed."""
    if _on_cpu(*tensors):
        return _native.for_group(group)
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    nccl = _nccl.for_group(group, next(iter(devices)))
    return nccl if nccl is not None and nccl.usable(*tensors) else None


def _route_cpu(group, *tensors):
    """For the verbs only the native CPU transport carries (reduce, scatter, the list forms)."""
    return _native.for_group(group) if _on_cpu(*tensors) else None


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    traffic.count("all_reduce", "all_reduce", group, _nbytes(tensor))
    native = _route(group, tensor)
    if native is not None and native.reducible(tensor.dtype, op):
        return native.all_reduce(tensor, op, async_op)
    return _torch.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    native = _route_cpu(group, tensor)
    if native is not None and native.reducible(tensor.dtype, op):
        return native.reduce(tensor, dst, op, async_op)
    return _torch.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    traffic.count("reduce_scatter", "scatter", group, _nbytes(input))
    native = _route(group, output, input)
    if native is not None and native.reducible(output.dtype, op):
        return native.reduce_scatter_tensor(output, input, op, async_op)
    if not _TORCH_LACKS_REDUCE_SCATTER:
        try:
            return _torch.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
        except RuntimeError as e:
            _note_missing_reduce_scatter(e)
    return _reduce_scatter_by_all_reduce(output, input, op, group, async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    """DeepSpeed's name for reduce_scatter_tensor (``prof`` and ``debug``, its profiler's, are ignored)."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    traffic.count("reduce_scatter", "scatter", group, sum(_nbytes(t) for t in input_list))
    native = _route_cpu(group, output, *input_list)
    if native is not None and native.reducible(output.dtype, op):
        return native.reduce_scatter(output, input_list, op, async_op)
    if not _TORCH_LACKS_REDUCE_SCATTER:
        try:
            return _torch.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        except RuntimeError as e:
            _note_missing_reduce_scatter(e)
    return _reduce_scatter_by_all_reduce(output, torch.cat([t.reshape(-1) for t in input_list]), op, group, async_op)


# gloo before torch 2.6 has no reduce-scatter ("ProcessGroupGloo does not support reduce_scatter"): there
# the torch transport all-reduces a copy of the whole input and keeps this rank's chunk (what DeepSpeed
# does for such backends too), with the same sum per element as a reduce-scatter would give.
_TORCH_LACKS_REDUCE_SCATTER = False


def _note_missing_reduce_scatter(error: RuntimeError) -> None:
    global _TORCH_LACKS_REDUCE_SCATTER
    if "does not support reduce_scatter" not in str(error):
        raise error
    _TORCH_LACKS_REDUCE_SCATTER = True


def _reduce_scatter_by_all_reduce(output, flat_input, op, group, async_op):
    rank = dist.get_rank(group)
    whole = flat_input.reshape(-1).clone()
    work = _torch.all_reduce(whole, op=op, group=group, async_op=async_op)

    def keep_own_chunk():
        output.copy_(whole.view(-1, output.numel())[rank].view_as(output))

    if async_op:
        return _Then(work, keep_own_chunk)
    keep_own_chunk()
    return None


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    traffic.count("all_gather", "gather", group, _nbytes(input_tensor))
    native = _route(group, output_tensor, input_tensor)
    if native is not None:
        return native.all_gather_into(output_tensor, input_tensor, async_op)
    return _torch.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    traffic.count("all_gather", "gather", group, _nbytes(tensor))
    native = _route_cpu(group, tensor, *tensor_list)
    if native is not None:
        return native.all_gather(tensor_list, tensor, async_op)
    return _torch.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    """A bucket of all-gathers in one collective: rank r's input_tensors[j] lands in
    output_tensors[j] (world x its elements, rank-major). One op with no flatten copy natively."""
    native = _route(group, *output_tensors, *input_tensors)
    if native is not None and all(t.is_contiguous() for t in (*output_tensors, *input_tensors)):
        traffic.count("all_gather", "gather", group, sum(_nbytes(t) for t in input_tensors))
        return native.all_gather_group(list(output_tensors), list(input_tensors), async_op)
    works = [all_gather_into(o, i, group, async_op) for o, i in zip(output_tensors, input_tensors)]
    return _Joined(works) if async_op else None


def all_gather_v(output, inp, counts, group=None, async_op=False):
    """Rank r's ``counts[r]`` elements (its ``inp``) laid end to end in rank order into ``output``
    (``sum(counts)`` elements): an all-gather of unequal parts, e.g. a parameter's fragments. Natively
    one op moving only the real bytes; on torch.distributed an all-gather of parts padded to the
    largest, then a copy."""
    if inp.numel() != counts[dist.get_rank(group)] or output.numel() != sum(counts):
        raise ValueError(f"all_gather_v: this rank's part has {inp.numel()} elements, counts say "
                         f"{counts[dist.get_rank(group)]}; output {output.numel()} vs {sum(counts)}")
    native = _route(group, output, inp)
    if native is not None and output.is_contiguous():
        traffic.count("all_gather", "gather", group, _nbytes(inp))
        return native.all_gather_v(output, inp, counts, async_op)
    most = max(counts)
    padded = output.new_zeros(len(counts) * most)
    padded[:inp.numel()].copy_(inp.reshape(-1))
    work = all_gather_into(padded, padded[:most].clone(), group, async_op)

    def unpack():
        pos = 0
        for r, n in enumerate(counts):
            output.view(-1)[pos:pos + n].copy_(padded[r * most:r * most + n])
            pos += n
    if not async_op:
        unpack()
        return None
    return _Then(work, unpack)


def broadcast(tensor, src, group=None, async_op=False):
    traffic.count("broadcast", "broadcast", group, _nbytes(tensor), src)
    native = _route(group, tensor)
    if native is not None:
        return native.broadcast(tensor, src, async_op)
    return _torch.broadcast(tensor, src, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    native = _route_cpu(group, tensor, *(scatter_list or ()))
    if native is not None:
        return native.scatter(tensor, scatter_list, src, async_op)
    return _torch.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def barrier(group=None, async_op=False, device_ids=None):
    native = _native.for_group(group)
    if native is not None and device_ids is None:
        return native.barrier(async_op)
    if device_ids is None:
        return _torch.barrier(group=group, async_op=async_op)
    return _torch.barrier(group=group, async_op=async_op, device_ids=device_ids)


_LIST_ALLGATHER = False  # set once this backend refused all_gather_into_tensor (gloo in older torch)


def all_gather_into(output: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's ``inp`` into ``output``, rank-major (``world * inp.numel()`` elements):
    all_gather_into_tensor, or the list form where the torch backend lacks it. ``inp`` may be a view
    of ``output``."""
    global _LIST_ALLGATHER
    traffic.count("all_gather", "gather", group, _nbytes(inp))
    native = _route(group, output, inp)
    if native is not None:
        return native.all_gather_into(output, inp, async_op)
    if not _LIST_ALLGATHER:
        try:
            return _torch.all_gather_into_tensor(output, inp, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError, AttributeError):
            _LIST_ALLGATHER = True
    world = dist.get_world_size(group)
    return _torch.all_gather(list(output.view(world, -1).unbind(0)), inp.clone(), group=group, async_op=async_op)


def all_gather_base(output_tensor, tensor, group=None, async_op=False):
    """DeepSpeed's older name of all_gather_into_tensor."""
    return all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


class _Joined:
    """Several works waited as one."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait()
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


class _Then:
    """A work, then a step once it completed (wait() runs it once)."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self, timeout=None):
        self.work.wait()
        then, self.then = self.then, None
        if then is not None:
            then()
        return True

    def is_completed(self):
        return self.work.is_completed()
