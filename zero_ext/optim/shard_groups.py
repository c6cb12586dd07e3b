"""ZeRO stage 3, optimizer side: sub-groups of pieces, gradient reduce-scatter into them, the step.

The parameter side — pieces, gathering around each module, zero.Init — is zero_ext/zero/ (ZeroModel).
Here:
- ``ShardGroup``: one optimizer sub-group (planner.sub_groups: whole parameters, DeepSpeed's
  boundaries). Its parameters' pieces are moved back to back into one buffer (DeepSpeed's
  "defragmentation"), so the master of the sub-group (fp32, or bf16 with bf16_master_weights_and_grads)
  is one tensor — the buffer itself when the model is in the master dtype — and so is its gradient
  partition (in the master dtype). It has FlatGroup's interface, so the step
  pipeline (zero_optimizer.py) and the state routines (utils/safe_state.py) serve stage 3 unchanged.
- ``ShardReducer``: each parameter's full gradient (handed over by ZeroModel once per backward) goes
  into a bucket; a full bucket is laid out rank-major (planner.shard_bucket_pieces: rank r's block
  holds piece r of every parameter) and reduce-scattered — NCCL's reduce_scatter_tensor, or on gloo an
  all-reduce of which each rank keeps its block (gloo's reduce-scatter is slower, or missing in older
  torch). The full gradient is freed at once. With ``overlap_comm`` the reductions are asynchronous,
  at most two in flight, and finished at the end of backward. With ZeRO++ qgZ
  (``zero_quantized_gradients``) a bucket goes through quantized_reduce.py's int4 all-to-all instead
  (two, intra-node then inter-node, where the world spans several nodes): on CPU in flight as the plain
  reductions (the second level runs when the bucket is completed), on CUDA synchronously. With MiCS
  (zero/mics.py) all of this runs inside the shard group (qgZ in one level there), and each reduced
  block is then all-reduced over the replica group (the ranks holding the same pieces) before it is
  added: the sum over every rank, averaged over every rank as without MiCS.
After the step the pieces hold the new values: nothing is all-gathered; modules gather what they need
at their next forward, and ZeroModel refreshes the persistent parameters.
"""
import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from .. import comm
from .._native import cuda, planner
from ..precision.autocast import sort_dtypes
from .grad_reduce import Averaging, StreamingReducer, accumulate
from .quantized_reduce import reduce_scatter_per_piece, reduce_scatter_quantized
from .step_check import agree_on_reduction
from .._native.planner import Piece


class ShardGroup:
    partitioned = True
    lp_grad = None

    def __init__(self, zparams, rank: int, world: int, host=None, process_group=None,
                 master_dtype: torch.dtype = torch.float32):
        self.zparams = zparams
        self.pg = process_group  # the partition group (the world, or a MiCS shard group)
        self.params = [zp.param for zp in zparams]
        self.numels = [zp.numel for zp in zparams]
        self.shards = [zp.shard_numel for zp in zparams]
        self.rank, self.world = rank, world
        self.offsets, total = [], 0
        for s in self.shards:
            self.offsets.append(total)
            total += s
        self.part = self.padded = total
        self.lo, self.hi = 0, total
        self.dtype = zparams[0].dtype
        device = zparams[0].shard.device
        self.flat = torch.zeros(total, dtype=self.dtype, device=device)
        for zp, off, s in zip(zparams, self.offsets, self.shards):
            zp.replace_shard(self.flat[off:off + s])
        self.master_dtype = master_dtype  # fp32, or bf16 with bf16_master_weights_and_grads (optim/bf16_master.py)
        # with optimizer offload (offload/plan.py) the master and gradient partition are host tensors of their own
        self.offloaded = host is not None
        self.host = host
        if self.offloaded:
            self.master = host.copy_of(self.flat, master_dtype)
            self.grad = host.zeros(total, master_dtype)
        else:  # the model in the master dtype: the master is the pieces themselves
            self.master = self.flat if self.dtype == master_dtype else self.flat.to(master_dtype)
            self.grad = torch.zeros(total, dtype=master_dtype, device=device)
        self.master.grad = self.grad
        self._hooks = [zp.register_update_hook(self._piece_overwritten) for zp in zparams]

    def _piece_overwritten(self, zp) -> None:
        """GatheredParameters(modifier_rank=...) or Module.apply rewrote a piece: the master follows."""
        if self.master.data_ptr() != self.flat.data_ptr():
            i = self.params.index(zp.param)
            off, s = self.offsets[i], self.shards[i]
            with self.materialize(), torch.no_grad():
                self.master[off:off + s].copy_(self.flat[off:off + s])

    @staticmethod
    def materialize():
        """The master in memory for a write (NVMe offload replaces this per group; see attach_nvme)."""
        return contextlib.nullcontext()

    def piece_of(self, i: int):
        """This rank's piece of parameter i as a planner Piece (its real elements), or None."""
        valid = planner.shard_valid(self.numels[i], self.world, self.rank)
        if valid == 0:
            return None
        return Piece(i, self.rank, self.rank * self.shards[i], self.offsets[i], -1, valid)

    def copy_master_to_params(self) -> None:
        if self.master.data_ptr() != self.flat.data_ptr() and not cuda.cast_into(self.flat, self.master):
            self.flat.copy_(self.master)  # CPU, or no CUDA library: torch's copy (on CUDA: kernels/cast.cu)

    def grad_sq_norm(self) -> torch.Tensor:
        return torch.linalg.vector_norm(self.grad, dtype=torch.float32).double() ** 2

    def tensors(self):
        return [("params", self.flat), ("fp32_master", self.master), ("fp32_grads", self.grad)]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class ShardReducer(StreamingReducer):
    """Reduce-scatters full gradients into this rank's pieces during backward (see the module docstring)."""

    MAX_IN_FLIGHT = 2

    def __init__(self, groups: List[ShardGroup], zero_model, bucket_size: int, overlap: bool, averaging: Averaging,
                 rank: int, world: int, ignore_unused: bool, process_group=None, quantized: bool = False,
                 replicas=None, hierarchy=None):
        self.groups, self.rank, self.world, self.pg = groups, rank, world, process_group
        self.replicas = replicas  # MiCS: the group of ranks holding the same pieces (zero/mics.py), or None
        self.quantized = quantized  # ZeRO++ qgZ (quantized_reduce.py), in two levels with a Hierarchy
        self.hierarchy = hierarchy
        self.avg, self.overlap, self.ignore_unused = averaging, overlap, ignore_unused
        self.bucket_size = max(1, bucket_size)
        self.where: Dict[int, Tuple[int, int]] = {id(zp): (gi, i) for gi, g in enumerate(groups)
                                                  for i, zp in enumerate(g.zparams)}
        self.index = {key: k for k, key in enumerate(self.where)}  # position in the optimizer: every rank's
        # one bucket per communication dtype: [members, numel] (one dtype unless torch_autocast gives some
        # parameters another)
        self.buckets: Dict[torch.dtype, list] = {}
        self.pending: List = []
        self.seen = set()
        self.given: Dict[int, torch.Tensor] = {}  # gradients handed to _add, by id(zp), until flushed
        self._leaf_grads: Dict[int, torch.Tensor] = {}
        self.deferred: Optional[Dict[int, torch.Tensor]] = None  # coalesce_grad_reduction: id(zp) -> summed grad
        self.buffers: List[torch.Tensor] = []  # in flight, for memory accounting
        # ranks confirm the fetches made along the prefetch trace before each reduction, so that one
        # that left the trace raises rather than meeting a reduction with a gather (zero/coordinator.py)
        self.verify_fetch_order = zero_model.verify_fetch_order
        self.handles = [zero_model.register_grad_ready_hook(self._on_grad),
                        zero_model.register_backward_end_hook(self.finish_backward)]

    @property
    def reduces(self) -> bool:
        """Whether gradients are summed over several ranks (then averaged)."""
        return self.world > 1 or self.replicas is not None

    def begin_deferral(self) -> None:
        """From now on each backward's full gradients are summed here, beside the partitioned parameters,
        instead of reduced (coalesce.py); end_deferral(flush=True) reduces them as one backward would."""
        self.deferred = {}

    def end_deferral(self, flush: bool) -> None:
        deferred, self.deferred = self.deferred, None
        if not flush:
            return
        for g in self.groups:  # in optimizer order, the same on every rank (leaves: finish_backward's)
            for zp in g.zparams:
                if id(zp) in deferred and not getattr(zp.param, "ds_z3_leaf_module", False):
                    zp.param.grad = None
                    self._add(zp, deferred.pop(id(zp)))
        self._leaf_grads = deferred
        self.finish_backward()

    def _defer(self, zp) -> None:
        grad = zp.param.grad
        if grad is None:
            return
        zp.param.grad = None
        held = self.deferred.get(id(zp))
        if held is None:
            self.deferred[id(zp)] = grad.detach().reshape(-1).clone()
        else:
            held.add_(grad.reshape(-1))

    def _on_grad(self, zp) -> None:
        if id(zp) not in self.where:
            return  # not trained by this engine (frozen, or outside its param groups)
        if self.deferred is not None:
            self._defer(zp)
            return
        if getattr(zp.param, "ds_z3_leaf_module", False):
            return  # a leaf's parameters are reduced together at the end of backward (see finish_backward)
        self._add(zp)

    def _add(self, zp, grad: Optional[torch.Tensor] = None) -> None:
        """Into its dtype's bucket: zp's gradient, ``param.grad`` unless given (a deferred one, flat)."""
        dtype = self.avg.dtype_of(zp.param)
        bucket = self.buckets.get(dtype)
        if bucket is not None and bucket[0] and bucket[1] + zp.numel > self.bucket_size:
            self._flush(dtype)
        if grad is not None:
            self.given[id(zp)] = grad
        bucket = self.buckets.setdefault(dtype, [[], 0])
        bucket[0].append(zp)
        bucket[1] += zp.numel
        self.seen.add(id(zp))

    def flush(self) -> None:
        """Reduces every bucket (DeepSpeed's order: the communication dtypes by name)."""
        for dtype in sort_dtypes(list(self.buckets)):
            self._flush(dtype)

    def _flush(self, dtype: torch.dtype) -> None:
        members = self.buckets.pop(dtype, [[], 0])[0]
        if not members:
            return
        if self.world == 1 and self.replicas is None:  # one rank: each piece is the whole parameter
            for zp in members:
                gi, i = self.where[id(zp)]
                g = self.groups[gi]
                accumulate(g.grad[g.offsets[i]:g.offsets[i] + g.shards[i]], self._full_grad(zp), 1.0)
                zp.param.grad = None
            return
        while len(self.pending) >= self.MAX_IN_FLIGHT:
            self._complete(self.pending[0])
        numels = [zp.numel for zp in members]
        device = members[0].shard.device
        self.verify_fetch_order()
        # a module skipped on some ranks (persistent parameters need no gather, so no fetch-order
        # check saw it) leaves them other buckets: every rank confirms this one (step_check.py)
        agree_on_reduction([self.index[id(zp)] for zp in members], numels, self.pg, device,
                           first_ds_id=members[0].ds_id)
        if self.quantized and self.world > 1 and device.type == "cpu":  # in flight with overlap_comm
            entry = (self._reduce_quantized(members, dtype), None, members)
            if self.overlap:
                self.pending.append(entry)
            else:
                self._complete(entry)
            return
        block, pieces = planner.shard_bucket_pieces(numels, self.world, list(range(len(members))))
        buf = torch.zeros(self.world * block, dtype=dtype, device=device)
        grads = [self._full_grad(zp) for zp in members]
        for p in pieces:
            buf[p.bucket_offset:p.bucket_offset + p.length].copy_(grads[p.param][p.param_offset:p.param_offset + p.length])
        for zp in members:
            zp.param.grad = None  # copied: the full gradient is freed now
        handle = None
        if self.avg.pre != 1.0 and self.reduces:
            buf.mul_(self.avg.pre)
        if self.world > 1:
            if self.quantized:  # (CUDA) piece by piece, in one or two levels, synchronous: an fp32 sum back
                layout, at = [], 0
                for zp in members:  # 1-D parameters travel unquantized (see quantized_reduce.py)
                    layout.append((at, zp.shard_numel, len(zp.shape) > 1))
                    at += zp.shard_numel
                buf = reduce_scatter_per_piece(buf, block, layout, self.pg, self.rank, self.world, self.hierarchy)
            elif buf.is_cuda:
                out = torch.empty(block, dtype=dtype, device=buf.device)
                handle = comm.reduce_scatter_tensor(out, buf, group=self.pg, async_op=self.overlap)
                buf = out
            else:
                handle = comm.all_reduce(buf, group=self.pg, async_op=self.overlap)
                buf = buf[self.rank * block:(self.rank + 1) * block]
        entry = (handle, buf, members)
        self.buffers.append(buf)
        if self.overlap and handle is not None:
            self.pending.append(entry)
        else:
            self._complete(entry)

    def _reduce_quantized(self, members, dtype: torch.dtype):
        """qgZ on CPU: this rank's block as an fp32 sum (a PendingReduce), packed straight from the full
        gradients, which are then freed (quantized_reduce.py; with ``hierarchy``, two levels)."""
        grads = [self._full_grad(zp).to(dtype).contiguous() for zp in members]
        if self.avg.pre != 1.0:
            grads = [g * self.avg.pre for g in grads]
        for zp in members:
            zp.param.grad = None
        return reduce_scatter_quantized(grads, [zp.shard_numel for zp in members],
                                        [len(zp.shape) > 1 for zp in members], self.pg, self.rank, self.world,
                                        self.hierarchy)

    def _complete(self, entry) -> None:
        handle, block, members = entry
        if handle is not None:
            finished = handle.wait()
            if block is None:  # qgZ: the wait gives the reduced block
                block = finished
        if self.replicas is not None:  # MiCS: the shard group's sum, summed over the replicas
            comm.all_reduce(block, group=self.replicas)
        post = self.avg.post if self.reduces else 1.0
        pos = 0
        for zp in members:
            gi, i = self.where[id(zp)]
            g = self.groups[gi]
            accumulate(g.grad[g.offsets[i]:g.offsets[i] + g.shards[i]], block[pos:pos + g.shards[i]], post)
            pos += g.shards[i]
        self.pending = [e for e in self.pending if e is not entry]
        self.buffers = [b for b in self.buffers if b is not block]

    def _full_grad(self, zp) -> torch.Tensor:
        given = self.given.pop(id(zp), None)
        return given if given is not None else _param_grad(zp)

    def finish_backward(self) -> None:
        if self.deferred is not None:  # coalesce_grad_reduction: a leaf's gradients are summed like the others
            for zp in (z for g in self.groups for z in g.zparams if getattr(z.param, "ds_z3_leaf_module", False)):
                self._defer(zp)
            return
        leaf_grads, self._leaf_grads = self._leaf_grads, {}
        # Leaf modules (zero/leaf.py) run their children in a data-dependent order, so their parameters'
        # gradients arrive in a different order, or not at all, on each rank: they are reduced here, in
        # ds_id order on every rank, an unused one as zeros (DeepSpeed fills zeros for unused experts).
        leaves = sorted((zp for g in self.groups for zp in g.zparams
                         if getattr(zp.param, "ds_z3_leaf_module", False)), key=lambda z: z.ds_id)
        for zp in leaves:
            self._add(zp, leaf_grads.get(id(zp)))
        self.flush()
        self.wait_all()
        unused = [zp.name for g in self.groups for zp in g.zparams if id(zp) not in self.seen]
        self.seen = set()
        self.check_unused(unused)

    def remove_hooks(self) -> None:
        super().remove_hooks()
        for g in self.groups:
            g.remove_hooks()


def _param_grad(zp) -> torch.Tensor:
    """A parameter's full gradient, flat; zeros for one that got none (an unused leaf's expert)."""
    if zp.param.grad is None:
        return torch.zeros(zp.numel, dtype=zp.dtype, device=zp.shard.device)
    return zp.param.grad.reshape(-1)


def _by_dtype(zps) -> List[List]:
    """The parameters split by dtype, each list in the original order, dtypes in order of first appearance."""
    runs: Dict[torch.dtype, List] = {}
    for z in zps:
        runs.setdefault(z.dtype, []).append(z)
    return list(runs.values())


def build_shard_groups(base: torch.optim.Optimizer, zero_model, sub_group_size: int, rank: int, world: int,
                       plan=None, on_group=None, process_group=None, master_dtype: torch.dtype = torch.float32):
    """Replaces each base param group's parameters by the fp32 masters of its sub-groups; returns
    (groups per base group — lists of ShardGroup —, all ShardGroups in order). ``plan`` (an
    OffloadPlan) says which sub-groups keep their master and gradients in host memory; ``on_group(k, g)``
    runs as each sub-group is made. ``rank``, ``world``, ``process_group``: the partition group's (with
    MiCS a shard group's, zero/mics.py)."""
    per_group, flat = [], []
    for group in base.param_groups:
        zps = [getattr(p, "_zero_owner", None) for p in group["params"] if p.requires_grad]
        missing = [z for z in zps if z is None]
        if missing:
            raise RuntimeError("ZeRO-3: a trainable parameter of the optimizer is not partitioned by the model's "
                               "ZeRO-3 hooks (is it a parameter of another module?)")
        zps = list({id(z): z for z in zps}.values())
        if not zps:
            group["params"] = []
            per_group.append([])
            continue
        members = []
        for same in _by_dtype(zps):  # a sub-group's buffer has one dtype: an fp32 adapter beside a bf16 base
            ids = planner.sub_groups([z.numel for z in same], world, sub_group_size)  # gets sub-groups of its own
            members += [[z for z, s in zip(same, ids) if s == k] for k in range(max(ids) + 1)]
        on_host = plan.host_subgroups([sum(z.numel for z in m) for m in members]) if plan else [False] * len(members)
        subs = []
        for m, h in zip(members, on_host):
            # bf16 masters are for 16-bit parameters: an fp32 parameter (a mixed-dtype model's adapter) keeps
            # an fp32 master, itself
            own = torch.float32 if m[0].dtype == torch.float32 else master_dtype
            subs.append(ShardGroup(m, rank, world, host=plan.host if h else None, process_group=process_group,
                                   master_dtype=own))
            if on_group is not None:  # (offload_param nvme: its pieces go to their swap file at once)
                on_group(len(flat) + len(subs) - 1, subs[-1])
        group["params"] = [s.master for s in subs]
        per_group.append(subs)
        flat += subs
    return per_group, flat
