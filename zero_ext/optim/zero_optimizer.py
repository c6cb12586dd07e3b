"""The ZeRO optimizer of every stage: owns the groups (flat groups, stage 3's shard sub-groups), reduces,
clips, steps, and re-gathers.

The base (torch) optimizer sees one fp32 tensor per param group — this rank's master partition
(see [Note: flat group tensors] in flat_group.py) — so its state is partitioned with it. ``step()`` is
DeepSpeed's pipeline: finish the gradient reduction, compute the global norm, detect overflow (fp16:
skip the step), unscale and clip in one multiply, step the base optimizer, write the masters back into
the model's dtype, all-gather the updated partitions.

Overflow needs no collective of its own: the global norm is a sum over every rank's partition, so an
inf or nan anywhere makes it non-finite on every rank, and all ranks skip the same steps.
"""
import contextlib
import math
from typing import List, Optional

import torch

from .. import comm
from ..comm.mpu import ParallelGroups, is_model_parallel_parameter
from .._native import planner
from ..config import ConfigError
from ..ops.functional import grad_sqnorm
from .factory import adopt_masters
from .flat_group import FlatGroup
from .ds_attributes import DeepSpeedAttributes
from .grad_views import GradientViews
from .loss_scaler import StaticLossScaler
from .factory import is_cpu_optimizer
from .nvme_step import nvme_step
from .experts import stage0_expert_sq


class ZeroOptimizer(GradientViews, DeepSpeedAttributes):
    """Returned by ``initialize`` as ``optimizer``; ``param_groups`` and ``state`` are the base's (DeepSpeed's
    gradient attributes: grad_views.py)."""

    def __init__(self, base: torch.optim.Optimizer, groups: List[Optional[FlatGroup]], reducer, stage: int,
                 gradient_clipping: float, allgather_bucket_size: int, rank: int, world: int,
                 loss_scaler: Optional[StaticLossScaler] = None, process_group=None, after_step=(),
                 nvme_pieces=None, model_parallel: Optional[ParallelGroups] = None):
        self.optimizer = base
        adopt_masters(base)
        self.groups = groups  # one per base param group; None for a group without trainable params
        self.flat_groups = [g for g in groups if g is not None]
        self.reducer, self.stage = reducer, stage
        self.clip = gradient_clipping
        self.allgather_bucket_size = allgather_bucket_size
        self.rank, self.world, self.pg = rank, world, process_group
        self.model_parallel = model_parallel if model_parallel is not None and model_parallel.mp_world > 1 else None
        self.global_grad_norm: Optional[float] = None
        self.loss_scaler = loss_scaler or StaticLossScaler(1.0)
        self.overflow = False
        self.check_overflow = True  # False (bf16.check_grad_overflow false): a non-finite gradient is stepped on
        self.reduced = False  # this step's gradients are averaged already
        self.after_step_hooks = list(after_step)  # run after each applied step (stage 3: refresh persistent pieces)
        self.nvme = None  # ZeRO-Infinity: the NVMeStateStore holding masters and optimizer state (attach_nvme)
        self.nvme_pieces = nvme_pieces  # offload_param nvme: the 16-bit pieces in swap files (nvme/pieces.py)
        self._pipeline = (False, False)
        self._materialized = set()  # NVMe groups held in ordinary memory by materialized()
        self._slices = {}  # stages 1/2 NVMe: group index -> its partition's sub-group ranges (nvme_slices)
        # each trainable parameter's place (flat group, index), for the state routines (utils/safe_state.py);
        # the groups hold the parameters, so their ids stay valid while this optimizer lives
        self._places = {id(p): (gi, i) for gi, g in enumerate(self.flat_groups) for i, p in enumerate(g.params)}

    # torch.optim.Optimizer's surface, delegated
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def __repr__(self):
        return f"ZeroOptimizer(stage={self.stage}, base={type(self.optimizer).__name__})"

    # -- the step ----------------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        self.reducer.reduce(self.world)
        self.reduced = True

    def ensure_reduced(self) -> None:
        """Averages this step's gradients now (once) — for the state routines, which read them early."""
        if not self.reduced:
            self.reduce_gradients()

    def place_of(self, param) -> Optional[tuple]:
        """(flat group index, index in it) of a parameter this optimizer steps, else None."""
        return self._places.get(id(param))

    def params(self):
        """Every parameter this optimizer steps."""
        return [p for g in self.flat_groups for p in g.params]

    def end_of_step(self) -> None:
        """Forgets this step's gradients (after the step, at zero_grad, and when a checkpoint is loaded)."""
        self.reducer.after_step()
        self.reduced = False

    def grad_sq_norm(self) -> float:
        """The squared global L2 norm of the (still loss-scaled) averaged gradients over every rank.
        Gradient partitions in host memory are summed by the C kernel (every core, fp64 accumulation, one
        pass at memory speed): torch's single-threaded fp32 norm on CPU drifts (-0.8% at 5e7 elements)."""
        # stage 0's expert groups (optim/experts.py) hold different values on the ranks of an expert-parallel
        # group: summed over that group apart; every other gradient is replicated or a partition
        apart = [g for g in self.flat_groups if self.stage == 0 and getattr(g, "domain", None) is not None]
        mine = [g for g in self.flat_groups if not any(g is a for a in apart)]
        local = sum(grad_sqnorm(g.grad) for g in mine if g.grad.is_cpu)
        sq = torch.tensor(local, dtype=torch.float64, device=self._device())
        for g in mine:
            if not g.grad.is_cpu:
                sq += g.grad_sq_norm()
        if apart:
            sq += stage0_expert_sq(apart, sq.device)
        if self.model_parallel is not None:
            return self._sq_norm_over_model_parallel(sq)
        if self.stage >= 1 and self.world > 1:
            comm.all_reduce(sq, group=self.pg)
        return sq.item()

    def _sq_norm_over_model_parallel(self, sq: torch.Tensor) -> float:
        """With an mpu (comm/mpu.py): the data-parallel sum, then the sum over the model-parallel group, where
        a parameter not split across model-parallel ranks counts on model-parallel rank 0 only."""
        mp = self.model_parallel
        both = torch.stack([sq, self._replicated_sq().to(sq.device)])
        if self.stage >= 1 and self.world > 1:
            comm.all_reduce(both, group=self.pg)
        mine = both[0] if mp.mp_rank == 0 else both[0] - both[1]
        comm.all_reduce(mine, group=mp.mp_group)
        return mine.item()

    def _replicated_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient of the parameters not marked model-parallel (fp64)."""
        sq = torch.zeros((), dtype=torch.float64)
        for g in self.flat_groups:
            if hasattr(g, "fragments"):  # stages 0-2: the parameters' runs inside this rank's partition
                runs = [(f.part_offset, f.length) for f in g.fragments
                        if not is_model_parallel_parameter(g.params[f.param])]
            else:  # stage 3: each parameter's piece, back to back
                runs = [(off, n) for p, off, n in zip(g.params, g.offsets, g.shards)
                        if not is_model_parallel_parameter(p)]
            for start, length in runs:
                sq += g.grad[start:start + length].double().pow(2).sum().cpu()
        return sq

    def step(self) -> bool:
        """One optimizer step; False when it was skipped for an fp16 overflow."""
        self.ensure_reduced()
        prepare = getattr(self.optimizer, "zero_prepare_step", None)
        if prepare is not None:  # Muon: its groups' gradients become the orthogonalized updates (optim/muon.py)
            prepare(self)
        scale = self.loss_scaler.cur_scale
        norm = math.sqrt(self.grad_sq_norm()) / scale
        self.global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        if self.overflow and self.check_overflow:
            self.end_of_step()
            self.loss_scaler.update(True)
            return False
        combined = 1.0 / self._combined_scale(norm * scale)  # unscale and clip in one pass over the gradients
        if self._fused():
            self._fused_step(combined)
        elif self.nvme is not None:  # a torch optimizer that streams its own NVMe state (Muon: optim/muon_nvme.py)
            self.optimizer.zero_nvme_step(self, combined)
        else:
            if combined != 1.0:
                for g in self.flat_groups:
                    g.grad.mul_(combined)
            self.optimizer.step()
            for g in self.flat_groups:
                g.copy_master_to_params()
        if self.stage in (1, 2) and any(g.world > 1 for g in self.flat_groups):
            self.all_gather_params()  # (stage 3 needs none: modules gather the new pieces when they run)
        self.end_of_step()
        for hook in self.after_step_hooks:
            hook()
        self.loss_scaler.update(False)
        return True

    def unscale_and_clip_grads(self, *args, apply_scale: bool = True) -> float:
        """DeepSpeed's method: the divisor that unscales and clips the gradients in one pass, from the norm of
        the still-scaled gradients — the loss scale, times norm / gradient_clipping when that is over 1 —
        and, with ``apply_scale``, the gradients divided by it. Its signatures: ``(total_norm)`` (DeepSpeed's
        FP16_UnfusedOptimizer) or ``(grad_groups_flat, total_norm)`` (its fused and ZeRO optimizers).
        ``step`` asks it for the divisor, through the signature of the optimizer DeepSpeed would run here,
        so a script (or test) that replaces it on the instance sees every step's norm."""
        grads, total_norm = (args[0], args[1]) if len(args) == 2 else ([g.grad for g in self.flat_groups], args[0])
        scale = self.loss_scaler.cur_scale
        divisor = scale
        if self.clip > 0:
            clip = (float(total_norm) / scale + 1e-6) / self.clip
            if clip > 1:
                divisor = clip * scale
        if apply_scale:
            for grad in grads:
                grad.mul_(1.0 / divisor)
        return divisor

    def _combined_scale(self, scaled_norm: float) -> float:
        """The step's divisor, through ``unscale_and_clip_grads`` in the signature of the optimizer DeepSpeed
        runs here (stage 0 over an unfused base: FP16_UnfusedOptimizer's; else the flat groups' form)."""
        if self.stage == 0 and not self.fused_base:
            return self.unscale_and_clip_grads(scaled_norm, apply_scale=False)
        return self.unscale_and_clip_grads([g.grad for g in self.flat_groups], scaled_norm, apply_scale=False)

    def _fused(self) -> bool:
        """Whether the C optimizer steps every master in host memory (ZeRO-Offload, or a CPU run)."""
        return is_cpu_optimizer(self.optimizer) and all(g.master.is_cpu for g in self.flat_groups)

    def _fused_step(self, combined: float) -> None:
        """The offloaded step in one pass over memory (csrc/cpu_adam.c): the gradients are unscaled and
        clipped as they are loaded, the masters updated, and the model's 16-bit copy written in the same
        pass — straight into the parameters when they are in host memory, else into a staging buffer
        that is then copied to the device."""
        if self.nvme is None and self.nvme_pieces is None:
            by_master = {id(g.master): g for g in self.flat_groups}
            targets = {id(g): _lp_target(g) for g in self.flat_groups}
            outs = [[targets[id(by_master[id(m)])] for m in pg["params"]] for pg in self.optimizer.param_groups]
            self.optimizer.step(fp16_param_groups=outs, grad_scale=combined)
            for g in self.flat_groups:
                _lp_upload(g, targets[id(g)])
            return
        # NVMe: one group at a time. Optimizer state streams through the store's buffers (the next read and
        # the previous write-back overlap this group's update with pipeline_read / pipeline_write), all or
        # nothing across the ranks ([Note: NVMe step transaction], nvme_step.py); with offload_param nvme
        # the group's 16-bit pieces are brought in as the output and written back.
        keys = list(range(len(self.flat_groups)))
        if self.nvme is None:
            for k in keys:
                self._step_group(k, combined)
            return
        streamed = []
        for k in keys:
            if k in self._slices and k not in self._materialized:
                streamed += [(k, j) for j in range(len(self._slices[k]))]
            elif k not in self._materialized:
                streamed.append(k)
        nvme_step(self, combined, streamed, self._step_slice, self._step_group, self._pipeline)
        for k in sorted(self._materialized):  # (a step inside materialized(): those are in memory)
            self._step_group(k, combined)

    def _step_slice(self, k: int, j: int, combined: float, staged: torch.Tensor) -> None:
        """Slice j of group k (resident in the store): the update of its master and state, and its part of
        the new parameters, into the group's staging buffer (nvme_step.py applies it after the step)."""
        g = self.flat_groups[k]
        a, b = self._slices[k][j]
        base = self.optimizer
        master, *states = self.nvme.tensors((k, j))
        group = next(pg for pg in base.param_groups if any(m is g.master for m in pg["params"]))
        step = int(base.state[g.master]["step"]) + 1
        fp32 = staged.dtype == torch.float32
        base.step_slice(group, master, g.grad[a:b], dict(zip(base.state_keys, states)), step,
                        out=None if fp32 else staged[a:b], grad_scale=combined)
        if fp32:
            staged[a:b].copy_(master)

    def _step_group(self, k: int, combined: float, staged: Optional[torch.Tensor] = None) -> None:
        """Whole group k (in memory, or resident in the store): its update, with the new parameters into
        ``staged`` when given (the NVMe step), else into the model (with offload_param nvme: its pieces)."""
        g = self.flat_groups[k]
        pieces = self.nvme_pieces.resident_key(("lp", k), modified=True) if self.nvme_pieces is not None \
            else contextlib.nullcontext()
        with pieces:
            fp32 = staged is not None and staged.dtype == torch.float32
            target = _lp_target(g) if staged is None else None if fp32 else staged
            outs = [[target if m is g.master else None for m in pg["params"]] for pg in self.optimizer.param_groups]
            self.optimizer.step(fp16_param_groups=outs, grad_scale=combined, params=[g.master])
            if staged is None:
                _lp_upload(g, target)
            elif fp32:
                staged.copy_(g.master)

    # -- NVMe (ZeRO-Infinity) -----------------------------------------------------------------------------

    def nvme_slices(self, g, sub_group_size: Optional[int]) -> List[tuple]:
        """Stages 1/2: the ranges [a, b) of a group's partition that NVMe offload swaps and steps as
        sub-groups of ``sub_group_size`` elements (stage 3's groups are sub-groups already: one range)."""
        n = g.hi - g.lo
        if self.stage == 3 or not sub_group_size or n <= sub_group_size:
            return [(0, n)]
        return [(a, min(a + sub_group_size, n)) for a in range(0, n, sub_group_size)]

    def attach_nvme(self, store, pipeline_read: bool, pipeline_write: bool, fast_init: bool,
                    sub_group_size: Optional[int] = None) -> None:
        """Moves every group's fp32 master and optimizer state to NVMe (nvme/store.py, NVMeStateStore).
        The state is created now (zeros, step 0: what the first step would create); with ``fast_init``
        the masters are written from the 16-bit partitions chunk by chunk, never whole in memory.
        Stages 1/2: a partition larger than ``sub_group_size`` goes as sub-groups (see _attach_slices)."""
        if not is_cpu_optimizer(self.optimizer) and not hasattr(self.optimizer, "zero_nvme_step"):
            raise ConfigError("zero_optimization.offload_optimizer.device = 'nvme' needs zero_ext's C optimizer: "
                              "give an 'optimizer' section of type Adam/AdamW/Adagrad/Lion/Muon (torch_adam too), "
                              "or pass CPUAdam")
        self.nvme, self._pipeline = store, (bool(pipeline_read), bool(pipeline_write))
        base = self.optimizer
        for k, g in enumerate(self.flat_groups):
            slices = self.nvme_slices(g, sub_group_size)
            if len(slices) > 1:
                self._attach_slices(k, g, slices, fast_init)
                continue
            keys = self._state_keys(g)
            if fast_init:
                old = g.master
                made = store.register_from_lp(k, [g.flat[g.lo:g.hi]], [g.hi - g.lo] * len(keys))
                g.master = made[0]
                for pg in base.param_groups:
                    pg["params"] = [g.master if m is old else m for m in pg["params"]]
                state = base.state[g.master]
                if is_cpu_optimizer(base):  # (a torch optimizer counts its own steps)
                    state["step"] = 0
                for key, t in zip(keys, made[1:]):
                    state[key] = t
                with store.resident(k, modified=False):  # (.grad must match the shape while assigned)
                    g.master.grad = g.grad
            else:  # the master keeps its .grad through the swaps
                state = base.state[g.master]
                base._init_state(g.master, state)
                store.register(k, [g.master] + [state[key] for key in keys])
            g.materialize = (lambda k=k: self.materialized([k]))  # stage 3's GatheredParameters writes masters

    def _attach_slices(self, k: int, g, slices: List[tuple], fast_init: bool) -> None:
        """[Note: stage-1/2 NVMe sub-groups] The optimizer keeps seeing one master per param group, but
        between materializations that master and its state tensors are empty (0 elements), and the
        values live in store groups (k, j), one per slice j of the partition, each with tensors of its
        own: the step streams them (_step_slice), materialized() assembles whole tensors from them and
        splits them back. Host memory then holds buffer_count slices, not the partition."""
        base, keys = self.optimizer, self._state_keys(g)
        for j, (a, b) in enumerate(slices):
            if fast_init:
                store_tensors = self.nvme.register_from_lp((k, j), [g.flat[g.lo + a:g.lo + b]], [b - a] * len(keys))
            else:
                store_tensors = [g.master[a:b].clone()] + [torch.zeros(b - a) for _ in keys]
                self.nvme.register((k, j), store_tensors)
        state = base.state[g.master]
        state.clear()
        if is_cpu_optimizer(base):  # (a torch optimizer counts its own steps)
            state["step"] = 0
        for key in keys:
            state[key] = torch.empty(0)
        g.master.grad = g.grad  # (kept through the master's empty spells, as with the whole-group swaps)
        g.master.data = torch.empty(0)
        self._slices[k] = slices
        g.materialize = (lambda k=k: self.materialized([k]))

    @contextlib.contextmanager
    def materialized(self, keys=None, modified: bool = True):
        """NVMe: the masters and optimizer state of groups ``keys`` (indices; default all) in ordinary host
        memory for the block — what the state routines, checkpoints and GatheredParameters read and write —
        and written back after it (unless ``modified`` is False); with offload_param nvme their 16-bit
        pieces too (default: every piece, frozen ones included). Without NVMe: nothing to do."""
        pieces = contextlib.nullcontext()
        if self.nvme_pieces is not None:
            pieces = self.nvme_pieces.materialized(modified, None if keys is None else [("lp", k) for k in keys])
        with pieces, self._materialized_states(keys, modified):
            yield

    @contextlib.contextmanager
    def _materialized_states(self, keys, modified: bool):
        if self.nvme is None:
            yield
            return
        keys = [k for k in (range(len(self.flat_groups)) if keys is None else keys) if k not in self._materialized]
        sliced = [k for k in keys if k in self._slices]
        store_keys = [k for k in keys if k not in self._slices]
        store_keys += [(k, j) for k in sliced for j in range(len(self._slices[k]))]
        with self.nvme.in_memory(store_keys, modified):
            for k in sliced:
                self._assemble(k)
            self._materialized.update(keys)
            try:
                yield
            finally:
                self._materialized.difference_update(keys)
                for k in keys:
                    if k in self._slices:
                        self._split(k, modified)
                    else:
                        self._relink_state(k)

    def _assemble(self, k: int) -> None:
        """Sliced group k's whole master and state, from its slices (in memory): see [Note: stage-1/2 NVMe
        sub-groups]."""
        g, base = self.flat_groups[k], self.optimizer
        parts = [self.nvme.tensors((k, j)) for j in range(len(self._slices[k]))]
        g.master.data = torch.cat([p[0] for p in parts])
        state = base.state[g.master]
        for i, key in enumerate(self._state_keys(g)):
            state[key] = torch.cat([p[1 + i] for p in parts])

    def _split(self, k: int, modified: bool) -> None:
        """The reverse of _assemble: the whole tensors' values (the state's may have been replaced, by
        load_state_dict) back into the slices, which the store then writes; the whole tensors go."""
        g, base = self.flat_groups[k], self.optimizer
        state = base.state[g.master]
        for j, (a, b) in enumerate(self._slices[k]):
            if modified:
                master, *states = self.nvme.tensors((k, j))
                master.copy_(g.master.data[a:b])
                for key, t in zip(self._state_keys(g), states):
                    t.copy_(state[key].reshape(-1)[a:b])
        g.master.data = torch.empty(0)
        for key in self._state_keys(g):
            state[key] = torch.empty(0)

    def _relink_state(self, k: int) -> None:
        """load_state_dict replaces state tensors: their values go into the registered (swapped) ones,
        which take their places in the state dict again."""
        g = self.flat_groups[k]
        state = self.optimizer.state[g.master]
        for key, t in zip(self._state_keys(g), self.nvme.tensors(k)[1:]):
            if state[key] is not t:
                t.data = state[key].data
                state[key] = t

    def _state_keys(self, g) -> tuple:
        """The optimizer state a group's swap file holds after its master: the C optimizer's keys (the same
        for every group), or those the base names for this group (Muon: optim/muon.py, nvme_state_keys)."""
        of = getattr(self.optimizer, "nvme_state_keys", None)
        return tuple(of(g.master)) if of is not None else tuple(getattr(self.optimizer, "state_keys", ()))

    def nvme_file_bytes(self, g) -> int:
        """The bytes a group's swap file needs: its fp32 master and each optimizer state tensor."""
        return (g.hi - g.lo) * 4 * (1 + len(self._state_keys(g)))

    def nvme_bytes(self):
        """(fp32 master bytes, optimizer state bytes) this rank keeps on NVMe: on the drive, so each
        sub-group's spare file counts too (twice the state: [Note: NVMe step transaction])."""
        if self.nvme is None:
            return 0, 0
        copies = 2 if self.nvme.spare_slot else 1
        masters = sum((g.hi - g.lo) * 4 for g in self.flat_groups) * copies
        return masters, sum((g.hi - g.lo) * 4 * len(self._state_keys(g)) for g in self.flat_groups) * copies

    def release(self) -> None:
        """engine.destroy(): drops the optimizer state, gradient partitions and communication buffers. The
        parameters' own storage (and an fp32 master that is that storage) stays with the model."""
        self.optimizer.state.clear()
        for g in self.flat_groups:
            g.master.grad = None
            g.grad = None
            if g.lp_grad is not None:
                for p in g.params:
                    p.grad = None
                g.lp_grad = None
            if getattr(g, "staging", None) is not None:
                g.staging = None
        self.reducer.free_buffers()

    def destroy_offload(self) -> None:
        """Removes the NVMe swap files (engine.destroy())."""
        if self.nvme is not None:
            self.nvme.destroy()

    def host_tensors(self) -> List[torch.Tensor]:
        """What this optimizer placed in host memory (ZeRO-Offload), for the memory account's tiers."""
        out = []
        for g in self.flat_groups:
            if getattr(g, "offloaded", False):
                out += [g.master, g.grad]
                out += [t for t in self.optimizer.state.get(g.master, {}).values() if torch.is_tensor(t)]
                if getattr(g, "staging", None) is not None:
                    out.append(g.staging)
        return out

    def all_gather_params(self) -> None:
        """Every rank's updated partition into every rank's flat buffer, allgather_bucket_size at a time."""
        for g in self.flat_groups:  # (each over its own group: an expert group's is expert-data-parallel)
            if g.world == 1 or not g.partitioned:
                continue
            chunk = planner.allgather_chunk(g.part, g.world, self.allgather_bucket_size)
            if chunk >= g.part:  # the flat buffer is rank-major partitions: one call fills it in place
                comm.all_gather_into(g.flat, g.flat[g.lo:g.hi].clone(), g.pg)
                continue
            for a in range(0, g.part, chunk):
                b = min(g.part, a + chunk)
                outputs = [g.flat[r * g.part + a:r * g.part + b] for r in range(g.world)]
                comm.all_gather(outputs, g.flat[g.lo + a:g.lo + b].clone(), group=g.pg)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the accumulated gradients (the flat buffers stay; parameters keep their views)."""
        self.end_of_step()

    def _device(self):
        return self.flat_groups[0].flat.device if self.flat_groups else torch.device("cpu")

    def tensors(self):
        """(kind, tensor) of everything this optimizer holds, for memory accounting."""
        out = [kt for g in self.flat_groups for kt in g.tensors()]
        out += [("comm_buffers", g.staging) for g in self.flat_groups if getattr(g, "staging", None) is not None]
        out += self.reducer.tensors()
        for state in self.optimizer.state.values():
            out += [("optimizer_state", t) for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
        return out


def _aliased(g) -> bool:
    """Whether the group's master *is* its partition of the parameters (an fp32 model, no offload)."""
    return g.master.data_ptr() == g.flat[g.lo:g.hi].data_ptr() and g.master.dtype == g.flat.dtype


def _lp_target(g) -> Optional[torch.Tensor]:
    """Where the fused step writes the group's new 16-bit values: None for an fp32 model (the master is
    copied, or is the parameters), the parameters' own partition in host memory, else a host staging
    buffer (pinned with pin_memory), made once and handed out again only after the upload that read it
    last completed (its event: the host must not overwrite what an asynchronous copy still reads)."""
    if _aliased(g) or g.dtype == torch.float32:
        return None
    if g.flat.is_cpu:
        return g.flat[g.lo:g.hi]
    if getattr(g, "staging", None) is None:
        g.staging = torch.empty(g.hi - g.lo, dtype=g.dtype, pin_memory=bool(g.host and g.host.pin))
    copied = getattr(g, "staging_copied", None)
    if copied is not None:  # the last upload (non_blocking, from pinned memory) may still be reading it
        copied.synchronize()
        g.staging_copied = None
    return g.staging


def _lp_upload(g, target: Optional[torch.Tensor]) -> None:
    """After the fused step: the new values into the parameters (device copy from host memory)."""
    if _aliased(g):
        return
    if target is None:
        g.copy_master_to_params()
    elif target.data_ptr() != g.flat[g.lo:g.hi].data_ptr():
        g.flat[g.lo:g.hi].copy_(target, non_blocking=True)
        if g.flat.is_cuda and target.is_pinned():  # asynchronous: the next _lp_target waits for this event
            g.staging_copied = torch.cuda.Event()
            g.staging_copied.record(torch.cuda.current_stream(g.flat.device))
