"""Gradient reduction for ZeRO stages 0-2: averaged gradients land in each owner's fp32 partition.

- Stages 0 and 1 (``BoundaryReducer``): autograd accumulates into each group's flat ``lp_grad``; at the
  accumulation boundary one pass reduces it in ``reduce_bucket_size`` chunks — all-reduce for stage 0,
  reduce-scatter for stage 1 (NCCL; on gloo, which has no reduce-scatter in every torch we support, an
  all-reduce of which each rank keeps its partition: twice the traffic, the same numbers).
- Stage 2 (``BucketReducer``): gradients are reduced during backward, bucket by bucket, as they become
  ready. A bucket filled in ready order is not split evenly by rank, so it is copied owner-major (the
  runs each rank owns, back to back, planned by csrc/planner.c) and each owner's region is reduced
  to that owner alone (``dist.reduce``): every element crosses the network once, to the one rank that
  needs it. With ``overlap_comm`` the reductions are asynchronous and two bucket buffers alternate;
  they are waited on at the end of backward. The parameters' ``.grad`` is freed as soon as its bucket
  is copied, so after backward a rank holds only its fp32 partition plus the buckets; after the step
  both go too (the next backward makes them again), unless the optimizer is offloaded, whose host
  partitions are pinned and kept.
"""
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import comm
from ..config.errors import EngineUsageError
from .._native import planner
from ..precision.autocast import get_comm_dtype, sort_dtypes
from .flat_group import FlatGroup
from .step_check import agree_on_reduction


class Averaging:
    """How gradients are averaged over N ranks and in which dtype they travel (DeepSpeed's keys):
    by default multiplied by 1/f before the reduction and by f/N after (gradient_predivide_factor f,
    default 1); with prescale_gradients divided by N before. ``summed`` (gradient_allreduce_op "sum"):
    neither, the ranks' gradients are added up. ``comm_dtype``: communication_data_type, or the
    gradients' own dtype. ``per_param`` (torch_autocast, stages 1-3): each parameter's gradient travels
    in its own communication dtype, DeepSpeed's ``get_comm_dtype``: the ``comm_dtype`` attribute of the
    autocast parameters, else the parameter's dtype (precision/autocast.py). ``alone``: the factor for a
    reducer whose group is one rank (nothing to reduce): 1, but 1/N for an expert group held by one
    rank of N (optim/experts.py: its gradient sums every rank's tokens already)."""

    alone = 1.0

    def __init__(self, world: int, comm_dtype: torch.dtype, prescale: bool = False, predivide: float = 1.0,
                 summed: bool = False, per_param: bool = False):
        self.comm_dtype = comm_dtype
        self.per_param = per_param
        if summed:
            self.pre = self.post = 1.0
            return
        self.pre = 1.0 / world if prescale else 1.0 / predivide
        self.post = 1.0 if prescale else predivide / world

    def dtype_of(self, param) -> torch.dtype:
        """The dtype ``param``'s gradient is reduced in."""
        return get_comm_dtype(param) if self.per_param else self.comm_dtype


def accumulate(dst: torch.Tensor, src: torch.Tensor, post: float) -> None:
    """dst += src * post: a reduced bucket's run into an fp32 gradient partition (no multiply for 1).
    With optimizer offload dst is in host memory: the run is copied over first, synchronously (the host
    add reads it at once). A 16-bit run is widened first: torch's mixed-dtype add on CPU is ~3x slower
    than a conversion followed by an fp32 add."""
    if dst.device != src.device:
        src = src.to(dst.device)
    if src.dtype != dst.dtype:
        src = src.to(dst.dtype)
    if post != 1.0:
        dst.add_(src, alpha=post)
    else:
        dst.add_(src)


def _chunks(n: int, size: int):
    size = max(1, size)
    for start in range(0, n, size):
        yield start, min(n, start + size)


class BoundaryReducer:
    """Stages 0 and 1: reduce the accumulated flat gradients once per optimizer step. Groups that
    accumulate in fp32 (``FlatGroup.acc_grad``) get each backward's gradients folded in by a callback
    at the end of that backward (queued by a post-accumulate hook of their parameters).

    Each parameter's ``.grad`` is its view of the group's flat ``lp_grad``, so autograd adds into the
    buffer in place. After a step the views are let go (``.grad`` is None, as torch's and DeepSpeed's
    ``zero_grad`` leave it); the buffer stays, and a hook that runs before the next backward's first
    gradient accumulates puts the views back, so that backward adds in place again. A ``.grad`` the
    script assigned by hand in between is kept, and the boundary copies it in (``collect_lp_grads``)."""

    def __init__(self, groups: List[FlatGroup], bucket_size: int, averaging: Averaging, process_group=None):
        self.groups, self.bucket_size, self.avg, self.pg = groups, bucket_size, averaging, process_group
        self._folding = [g for g in groups if g.acc_grad is not None]
        self._fold_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._queue_fold)
                       for g in self._folding for p in g.params]
        self._detached = False
        self._hooks += [p.register_hook(self._before_accumulate) for g in groups for p in g.params]
        self._runs = [self._dtype_runs(g) for g in groups]

    def _dtype_runs(self, g: FlatGroup) -> List[Tuple[int, int, torch.dtype]]:
        """[a, b) ranges of the flat buffer and the dtype each travels in: one range unless torch_autocast
        gives some parameters another communication dtype (each parameter's padding goes with it)."""
        if not self.avg.per_param:
            return [(0, g.padded, self.avg.comm_dtype)]
        runs: List[Tuple[int, int, torch.dtype]] = []
        for k, (p, off) in enumerate(zip(g.params, g.offsets)):
            end = g.offsets[k + 1] if k + 1 < len(g.params) else g.padded
            dtype = self.avg.dtype_of(p)
            if runs and runs[-1][2] == dtype:
                runs[-1] = (runs[-1][0], end, dtype)
            else:
                runs.append((0 if not runs else off, end, dtype))
        return runs

    def _before_accumulate(self, _grad) -> None:
        if self._detached:
            self._detached = False
            for g in self.groups:
                g.attach_lp_grads(keep_assigned=True)

    def _queue_fold(self, _param) -> None:
        if not self._fold_queued:
            self._fold_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._fold)

    def _fold(self) -> None:
        self._fold_queued = False
        for g in self._folding:
            g.fold_lp_grads()

    def reduce(self, world: int) -> None:
        for g, runs in zip(self.groups, self._runs):
            if g.acc_grad is not None:
                g.fold_lp_grads()  # (gradients that came without a backward callback: nothing, usually)
            else:
                g.collect_lp_grads()
            src = g.boundary_grad
            aliased = g.grad.data_ptr() == src[g.lo:g.hi].data_ptr()
            if world == 1:
                if not aliased:
                    g.grad.copy_(src)
                if self.avg.alone != 1.0:
                    g.grad.mul_(self.avg.alone)
                continue
            if g.partitioned and src.is_cuda and runs == [(0, g.padded, src.dtype)]:
                self._reduce_scatter(g)
                if not aliased:
                    g.grad.copy_(src[g.lo:g.hi])
            else:
                for start, end, dtype in runs:
                    for a, b in _chunks(end - start, self.bucket_size):
                        self._all_reduce_chunk(g, start + a, start + b, aliased, dtype)
            if self.avg.post != 1.0:
                g.grad.mul_(self.avg.post)

    def _all_reduce_chunk(self, g: FlatGroup, a: int, b: int, aliased: bool, dtype: torch.dtype) -> None:
        """All-reduces the flat gradient's [a:b] in the communication dtype ``dtype``; this rank keeps its
        partition's part."""
        chunk = g.boundary_grad[a:b]
        t = chunk if dtype == chunk.dtype else chunk.to(dtype)
        if self.avg.pre != 1.0:
            t.mul_(self.avg.pre)
        comm.all_reduce(t, group=self.pg)
        lo, hi = max(a, g.lo), min(b, g.hi)
        if lo < hi and not (aliased and t is chunk):
            g.grad[lo - g.lo:hi - g.lo].copy_(t[lo - a:hi - a])

    def _reduce_scatter(self, g: FlatGroup) -> None:
        chunk, src = max(1, self.bucket_size // g.world), g.boundary_grad
        if self.avg.pre != 1.0:
            src.mul_(self.avg.pre)
        for a, b in _chunks(g.part, chunk):
            inputs = [src[r * g.part + a:r * g.part + b] for r in range(g.world)]
            comm.reduce_scatter(src[g.lo + a:g.lo + b], inputs, group=self.pg)

    buffers = ()  # (it reduces in the gradients' own storage)

    def begin_deferral(self) -> None:
        """coalesce_grad_reduction (coalesce.py): these stages reduce only at the boundary already."""

    def end_deferral(self, flush: bool) -> None:
        pass

    def free_buffers(self) -> None:
        pass

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def after_step(self) -> None:
        for g in self.groups:
            g.lp_grad.zero_()
            if g.acc_grad is not None:
                g.acc_grad.zero_()
            if g.grad.data_ptr() != g.boundary_grad[g.lo:g.hi].data_ptr():
                g.grad.zero_()
            for p in g.params:
                p.grad = None
        self._detached = True

    def tensors(self):
        return []


class StreamingReducer:
    """What the reducers that work during backward (stage 2's, stage 3's) share: waiting for their
    asynchronous reductions, the unused-parameter check, clearing partitions, hook removal.
    Subclasses define flush(), _complete(entry) and keep ``pending``, ``buffers``, ``handles``."""

    def wait_all(self) -> None:
        while self.pending:
            self._complete(self.pending[0])

    def reduce(self, world: int) -> None:
        """Gradients were reduced during backward; only pending work remains."""
        self.flush()
        self.wait_all()

    def check_unused(self, unused: List[str]) -> None:
        if unused and not self.ignore_unused:
            raise EngineUsageError(f"{len(unused)} trainable parameter(s) received no gradient in this backward pass "
                               f"(first: {unused[0]}). Set zero_optimization.ignore_unused_parameters to true to "
                               "allow parameters unused in a step.")

    def free_buffers(self) -> None:
        """Drops the bucket buffers (nothing lives in them between steps; they are made again on use)."""
        self.wait_all()
        self.buffers = []

    def after_step(self) -> None:
        for g in self.groups:
            g.grad.zero_()

    def tensors(self):
        return [("comm_buffers", b) for b in self.buffers]

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class _Bucket:
    """Parameters whose gradients wait in one bucket: (group index, param index) in ready order."""

    def __init__(self):
        self.members: List[Tuple[int, int]] = []
        self.numel = 0


class BucketReducer(StreamingReducer):
    """Stage 2: reduce gradients to their owners during backward (see the module docstring)."""

    def __init__(self, groups: List[FlatGroup], bucket_size: int, overlap: bool, contiguous: bool, rank: int,
                 world: int, ignore_unused: bool, averaging: Averaging, process_group=None):
        self.groups, self.rank, self.world, self.pg = groups, rank, world, process_group
        # dist.reduce's dst is a global rank: each owner's (the group's ranks are not 0..N-1 with an mpu's
        # data-parallel group or an expert-data-parallel one)
        self.owners = [r if process_group is None else comm.get_global_rank(process_group, r) for r in range(world)]
        self.avg = averaging
        self.overlap, self.contiguous, self.ignore_unused = overlap, contiguous, ignore_unused
        numels = [n for g in groups for n in g.numels]
        self.bucket_size = max(1, bucket_size)
        # a buffer never needs more than every gradient, nor less than the largest one
        self.buffer_numel = min(max(self.bucket_size, max(numels)), sum(numels))
        self.device = groups[0].flat.device
        self.buffers: List[torch.Tensor] = []
        self._pool: Dict[torch.dtype, List[torch.Tensor]] = {}  # the bucket buffers of each comm dtype
        self._next: Dict[torch.dtype, int] = {}
        self.pending: List[tuple] = []  # (handles, buffer, bucket view, (my region start, my runs))
        # for each parameter, the runs each rank owns: (rank, param_offset, part_offset, length)
        self.runs: Dict[Tuple[int, int], List[Tuple[int, int, int, int]]] = {}
        for gi, g in enumerate(groups):
            for i in range(len(g.params)):
                pieces = planner.flat_bucket_pieces(g.numels, world, [i])
                self.runs[(gi, i)] = [(p.rank, p.param_offset, p.part_offset, p.length) for p in pieces]
        # each parameter's position in the optimizer (the same on every rank) and, set by build.py, its
        # name: for the agreement before each bucket (step_check.py)
        self.index = {key: k for k, key in enumerate(self.runs)}
        self.names: Dict[int, str] = {}
        # one bucket per communication dtype (one dtype unless torch_autocast gives some parameters another)
        self.dtypes = {(gi, i): averaging.dtype_of(p) for gi, g in enumerate(groups) for i, p in enumerate(g.params)}
        self.buckets: Dict[torch.dtype, _Bucket] = {}
        self.seen = set()
        self.callback_queued = False
        self.deferring = False  # inside coalesce_grad_reduction: gradients stay summed in param.grad
        self.handles = []
        for gi, g in enumerate(groups):
            for i, p in enumerate(g.params):
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(gi, i)))

    def reduce(self, world: int) -> None:
        super().reduce(world)
        for g in self.groups:  # a group that got no gradient this step steps on zeros, as before
            g.ensure_grad()

    def after_step(self) -> None:
        """The fp32 gradient partitions and the bucket buffers hold nothing the next backward needs: they
        go, and its first buckets make them again. Offloaded partitions (pinned host memory, slow to
        make) are kept and zeroed."""
        self.free_buffers()
        for g in self.groups:
            if g.offloaded:
                g.grad.zero_()
            else:
                g.free_grad()

    # -- backward ---------------------------------------------------------------------------------

    def begin_deferral(self) -> None:
        """From now on each backward leaves its gradients in ``param.grad``, where autograd sums them
        (coalesce.py); end_deferral(flush=True) reduces them as one backward would have."""
        self.deferring = True

    def end_deferral(self, flush: bool) -> None:
        self.deferring = False
        params = [(gi, i, p) for gi, g in enumerate(self.groups) for i, p in enumerate(g.params)]
        for gi, i, p in params:  # in optimizer order, the same on every rank
            if p.grad is not None:
                if flush:
                    self._take(gi, i)
                else:
                    p.grad = None
        if flush:
            self.finish_backward()

    def _take(self, gi: int, i: int) -> None:
        """Parameter i of group gi has its gradient: into the bucket (reduced when the bucket is full)."""
        n, dtype = self.groups[gi].numels[i], self.dtypes[(gi, i)]
        bucket = self.buckets.get(dtype)
        if bucket is not None and bucket.members and bucket.numel + n > self.bucket_size:
            self._flush(dtype)
        bucket = self.buckets.setdefault(dtype, _Bucket())
        bucket.members.append((gi, i))
        bucket.numel += n
        self.seen.add((gi, i))

    def _hook(self, gi: int, i: int):
        def on_grad_ready(param: torch.Tensor) -> None:
            if self.deferring:
                return
            if not self.callback_queued:
                # runs once when this backward pass ends, whoever called .backward()
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
                self.callback_queued = True
            self._take(gi, i)
        return on_grad_ready

    def finish_backward(self) -> None:
        self.flush()
        self.wait_all()
        self.callback_queued = False
        unused = [f"group {gi}, parameter {i}" for gi, g in enumerate(self.groups) for i in range(len(g.params))
                  if (gi, i) not in self.seen]
        self.seen = set()
        self.check_unused(unused)

    def free_buffers(self) -> None:
        super().free_buffers()
        self._pool, self._next = {}, {}

    def _buffer(self, numel: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the buffer, its first numel elements) for the next bucket of communication dtype ``dtype``."""
        if not self.contiguous:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            return buf, buf
        count = 2 if self.overlap else 1
        if dtype not in self._pool:
            self._pool[dtype] = [torch.empty(self.buffer_numel, dtype=dtype, device=self.device)
                                 for _ in range(count)]
            self.buffers = self.buffers + self._pool[dtype]
        k = self._next.get(dtype, 0)
        buf = self._pool[dtype][k]
        self._next[dtype] = (k + 1) % count
        # the reductions still reading this buffer must end before it is refilled
        for entry in [e for e in self.pending if e[1] is buf]:
            self._complete(entry)
        return buf, buf[:numel]

    def flush(self) -> None:
        """Reduces every bucket (DeepSpeed's order: the communication dtypes by name)."""
        for dtype in sort_dtypes(list(self.buckets)):
            self._flush(dtype)

    def _flush(self, dtype: torch.dtype) -> None:
        bucket = self.buckets.pop(dtype, None)
        if bucket is None or not bucket.members:
            return
        members, numel = bucket.members, bucket.numel
        if self.world > 1:  # every rank is about to reduce this same bucket (step_check.py)
            agree_on_reduction([self.index[m] for m in members], [self.groups[gi].numels[i] for gi, i in members],
                               self.pg, self.device, namer=lambda k: repr(self.names.get(k, f"#{k}")))
        if self.world == 1:  # nothing to reduce: straight from each gradient into the fp32 partition
            for gi, i in members:
                grad = self.groups[gi].params[i].grad.reshape(-1)
                part = self.groups[gi].ensure_grad()
                for _, poff, partoff, length in self.runs[(gi, i)]:
                    accumulate(part[partoff:partoff + length], grad[poff:poff + length], self.avg.alone)
                self.groups[gi].params[i].grad = None
            return
        # owner-major layout: each rank's runs back to back, ranks in order
        by_owner: List[List[Tuple[int, int, int, int, int]]] = [[] for _ in range(self.world)]
        for gi, i in members:
            for owner, poff, partoff, length in self.runs[(gi, i)]:
                by_owner[owner].append((gi, i, poff, partoff, length))
        base, buf = self._buffer(numel, dtype)
        regions, pos = [], 0
        for owner, runs in enumerate(by_owner):
            start = pos
            for gi, i, poff, _, length in runs:
                grad = self.groups[gi].params[i].grad
                buf[pos:pos + length].copy_(grad.reshape(-1)[poff:poff + length])
                pos += length
            regions.append((start, pos))
        for gi, i in members:
            self.groups[gi].params[i].grad = None  # copied: free it now
        handles = []
        if self.avg.pre != 1.0 and self.world > 1:
            buf.mul_(self.avg.pre)
        if self.world > 1:
            for owner, (a, b) in enumerate(regions):
                if b > a:
                    handles.append(comm.reduce(buf[a:b], dst=self.owners[owner], group=self.pg, async_op=self.overlap))
        a, _ = regions[self.rank]
        mine = [(gi, partoff, length) for gi, _, _, partoff, length in by_owner[self.rank]]
        entry = (handles, base, buf, (a, mine))
        if self.overlap:
            self.pending.append(entry)
        else:
            self._complete(entry)

    def _complete(self, entry) -> None:
        handles, _, buf, (pos, mine) = entry
        for h in handles:
            if h is not None:
                h.wait()
        post = self.avg.post if self.world > 1 else 1.0
        for gi, partoff, length in mine:
            accumulate(self.groups[gi].ensure_grad()[partoff:partoff + length], buf[pos:pos + length], post)
            pos += length
        self.pending = [e for e in self.pending if e is not entry]

