"""The collective facade: every collective zero_ext runs goes through these names, so there is one
place that decides how ranks talk (today torch.distributed's backends: gloo on CPU, NCCL on CUDA; the
native transport of csrc/comm plugs in here). Each is torch.distributed's function, with its
signature and semantics (a Work back when ``async_op``), and they are DeepSpeed's ``deepspeed.comm``
names too. ``all_gather_into`` is the one that adds something: the fallback for backends without
``all_gather_into_tensor``.
"""
import torch
import torch.distributed as dist

from .outstanding import tracked, tracked_objects

# Each goes through outstanding.run, which hands the backend aliases of the tensors and keeps them until
# its threads let go (see [Note: the exit race] in outstanding.py).
ReduceOp = dist.ReduceOp
all_reduce = tracked(dist.all_reduce)
all_gather = tracked(dist.all_gather)
all_gather_into_tensor = tracked(dist.all_gather_into_tensor)
reduce_scatter = tracked(dist.reduce_scatter)
reduce_scatter_tensor = tracked(dist.reduce_scatter_tensor)
reduce = tracked(dist.reduce)
broadcast = tracked(dist.broadcast)
barrier = tracked(dist.barrier)
gather = tracked(dist.gather)
scatter = tracked(dist.scatter)
all_to_all_single = tracked(dist.all_to_all_single)
send, recv, isend, irecv = tracked(dist.send), tracked(dist.recv), tracked(dist.isend), tracked(dist.irecv)
gather_object = tracked_objects(dist.gather_object)
all_gather_object = tracked_objects(dist.all_gather_object)

_LIST_ALLGATHER = False  # set once this backend refused all_gather_into_tensor (gloo in older torch)


def all_gather_into(output: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's ``inp`` into ``output``, rank-major (``world * inp.numel()`` elements):
    all_gather_into_tensor, or the list form where the backend lacks it. ``inp`` may be a view of
    ``output``."""
    global _LIST_ALLGATHER
    if not _LIST_ALLGATHER:
        try:
            return all_gather_into_tensor(output, inp, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError, AttributeError):
            _LIST_ALLGATHER = True
    world = dist.get_world_size(group)
    return all_gather(list(output.view(world, -1).unbind(0)), inp.clone(), group=group, async_op=async_op)


def all_gather_base(output_tensor, tensor, group=None, async_op=False):
    """DeepSpeed's older name of all_gather_into_tensor."""
    return all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)
