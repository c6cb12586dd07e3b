"""The training engine: DeepSpeed's ``DeepSpeedEngine`` surface over ZeRO stages 0-3.

    engine, optimizer, loader, scheduler = zero_ext.initialize(model=model, config=cfg)
    loss = engine(batch); engine.backward(loss); engine.step()

The engine wraps the user's module (``engine.module``; unknown attributes are forwarded to it), runs
what build.py made for it (the ZeRO optimizer, stage 3's ZeroModel, the NVMe stores) and counts steps.
``step()`` updates only at the accumulation boundary, every ``gradient_accumulation_steps`` micro steps.

[Note: the step lifecycle] Where the engine is in its step cycle is one value, ``engine.phase`` (a
:class:`StepPhase`), changed only by :meth:`ZeroEngine._advance` along the table ``TRANSITIONS``; an
event the table does not allow from the current phase raises the lifecycle error users see (backward
after an early reduction, gradients read when there are none, anything after destroy). Two
conditions sit beside it, because they nest around the cycle rather than being steps of it: inside
``no_sync()``, and states parked by ``offload_states()``.
"""
import contextlib
import logging
import os
import warnings
import weakref
from typing import Dict, FrozenSet, List, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import activation_checkpointing, comm
from .checkpoint import publish
from .checkpoint.engine_api import CheckpointMethods
from .checkpoint.engine_state import check_all_ranks_call
from .checkpoint.experts import with_every_expert
from .checkpoint.files import atomic_torch_save
from .config.engine_queries import ConfigQueries
from .config.errors import EngineUsageError
from .offload import states as offload_state
from .offload.memory import MemoryAccount
from .offload.plan import OffloadPlan
from .optim.coalesce import check_coalesce, deferred_reduction
from .optim.direct_backward import DirectBackward
from .optim.handed_out import hand_out, hands_out_base, take_back
from .optim.throughput import ThroughputTimer
from .optim.wall_clock import WallClock
from .optim.step_check import agree_on_step
from .optim.step_phase import TRANSITIONS, StepPhase  # noqa: F401 (importable from here)
from .precision.autocast import AutocastQueries, autocast_if_enabled
from .zero import GatheredParameters
from .zero.param import zero_param_of

logger = logging.getLogger("zero_ext.engine")


# trainable parameter (or wrapped module) -> the engine stepping it (weakly both ways): for the state
# routines (utils/safe_state.py), which are given only the parameter, and for a second initialize
_ENGINE_OF = WeakIdKeyDictionary()


def engine_of(param) -> Optional["ZeroEngine"]:
    """The live engine whose optimizer steps ``param``, or None."""
    ref = _ENGINE_OF.get(param)
    return ref() if ref is not None else None


def engine_of_module(module) -> Optional["ZeroEngine"]:
    """The live engine wrapping ``module``, or None."""
    ref = _ENGINE_OF.get(module)
    return ref() if ref is not None else None


class ZeroEngine(CheckpointMethods, ConfigQueries, AutocastQueries, torch.nn.Module):
    """Made by build.build_engine: ``optimizer`` is the ZeroOptimizer (None for a forward-only engine),
    kept as ``engine.zero_optimizer``; ``engine.optimizer`` is what initialize hands out (optim/handed_out.py).
    ``offload`` the config's OffloadPlan, ``zero_model`` stage 3's ZeroModel, ``nvme_pieces`` the store of
    stage 3's 16-bit pieces with ``offload_param.device = "nvme"``."""

    def __init__(self, module: torch.nn.Module, config, optimizer, offload: OffloadPlan,
                 device: Optional[torch.device] = None, zero_model=None, nvme_pieces=None, lr_scheduler=None,
                 training_dataloader=None):
        super().__init__()
        self.module = module
        self.zero_model = zero_model  # stage 3: the parameter-side hooks (zero/model.py)
        self._config = config
        self.device = device or torch.device("cpu")
        self.global_rank, self.world_size = comm.get_rank(), comm.get_world_size()
        self.dp_world_size = self.world_size
        self.local_rank = comm.get_local_rank()
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._backwards = 0  # backward passes since the last boundary step
        self.skipped_steps = 0
        self.phase = StepPhase.IDLE if optimizer is not None else StepPhase.FORWARD_ONLY
        self._step_applied = False  # what the last step() did (was_step_applied)
        self._warned_second_backward = False
        self._is_gradient_accumulation_boundary: Optional[bool] = None  # set_gradient_accumulation_boundary (DeepSpeed's name)
        self._collective_seq = 0  # counts collective calls, so a rank that skips one is detected
        self._offloaded = set()  # OffloadStateTypeEnum kinds parked in host memory (offload/states.py)
        self._failed: Optional[str] = None  # why this engine cannot go on (an NVMe write failed mid-step)
        self._no_sync: Optional[str] = None  # inside no_sync() or coalesce_grad_reduction(): that name
        self.offload = offload  # ZeRO-Offload placement (offload/plan.py)
        self.training_dataloader = training_dataloader
        self.zero_optimizer = optimizer  # the ZeroOptimizer (None: forward only)
        self.basic_optimizer = optimizer.optimizer if optimizer is not None else None  # (DeepSpeed's name)
        # what initialize returns: the base itself at stage 0 over fp32, as DeepSpeed (optim/handed_out.py)
        self.optimizer = hand_out(self) if optimizer is not None and hands_out_base(optimizer) else optimizer
        self.nvme_pieces = nvme_pieces
        self.lr_scheduler = lr_scheduler
        self.wall_clock = WallClock(config.wall_clock_breakdown, config.steps_per_print, self.global_rank)
        self.tput_timer = ThroughputTimer.for_engine(config)  # samples per second (DeepSpeed's timer, optim/throughput.py)
        self.sparse_tensor_module_names = set()  # DeepSpeed's: sparse_gradients is refused here, so always empty
        for key in [module] + (optimizer.params() if optimizer is not None else []):
            _ENGINE_OF[key] = weakref.ref(self)
        self.direct_backward = DirectBackward(self)  # loss.backward() called directly (optim/direct_backward.py)
        if optimizer is not None:  # DeepSpeed's averaged_gradients & co read through the same check (optim/grad_views.py)
            optimizer.gradient_reader = self.gradients

    # -- the step lifecycle ([Note: the step lifecycle]) -------------------------------------------------

    def _advance(self, event: str, what: str) -> None:
        """Moves ``phase`` along TRANSITIONS, or raises the lifecycle error for ``what`` (the call)."""
        after = TRANSITIONS[event].get(self.phase)
        if after is None:
            raise EngineUsageError(self._misuse(event, what))
        self.phase = after
        self._backwards += event == "backward"  # (engine.backward or a direct one: optim/direct_backward.py)

    def _misuse(self, event: str, what: str) -> str:
        if self.phase is StepPhase.DESTROYED:
            stage3 = ("; its ZeRO-3 parameters stay partitioned: read them under zero.GatheredParameters, or "
                      "make them whole with zero_ext.zero.unpartition") if self.zero_optimization_stage() == 3 else ""
            return (f"{what}: this engine was destroyed (engine.destroy()){stage3}; build a new one with "
                    "zero_ext.initialize")
        if self.phase is StepPhase.FORWARD_ONLY:
            return (f"{what}: this engine has no optimizer (initialize was given none and the config has no "
                    "'optimizer' section): it runs forward only")
        if event == "backward":  # from REDUCED
            return (f"{what}: this step's gradients were already averaged across ranks (a safe_get/safe_set "
                    "gradient call); call engine.step() before the next backward")
        if event in ("read_gradients", "reduce_early"):  # from IDLE
            return (f"{what}: there are no gradients now. Gradients exist after engine.backward() and before "
                    "the engine.step() that applies them (the step consumes and clears them).")
        return f"{what}: not allowed while the engine is {self.phase.value}"  # (the table has no other gaps)

    def gradients(self, what: str):
        """The state routines' access to this step's gradients (utils/safe_state.py): checks that they
        exist and, at stages 0/1, that this is the boundary, then averages them across ranks (once; at
        stages 0/1 no backward may follow before the step). Returns the ZeroOptimizer."""
        self._advance("read_gradients", what)
        if self._no_sync:  # (reading would average them now, against the block's purpose)
            raise EngineUsageError(f"{what}: inside engine.{self._no_sync}() the gradients are not averaged yet "
                                   "(that happens after the block); read them after the block")
        stage = self.zero_optimization_stage()
        if stage < 2 and not self.is_gradient_accumulation_boundary():
            raise EngineUsageError(f"{what}: in ZeRO stage {stage} gradients are averaged across ranks only at the "
                               "gradient-accumulation boundary; call it after the backward of the last micro step "
                               "(when engine.is_gradient_accumulation_boundary() is True), or use stage 2")
        self.zero_optimizer.ensure_reduced()
        if stage < 2:
            self._advance("reduce_early", what)
        return self.zero_optimizer

    def unaveraged_gradients(self, what: str) -> Optional[str]:
        """Inside ``no_sync()`` or ``coalesce_grad_reduction()`` the safe_get gradient reads return this
        rank's own accumulated gradient, as DeepSpeed's do (averaging it would defeat the block): the name
        of the block then (after the lifecycle check), else None and the caller reads averaged gradients
        through ``gradients``."""
        if self._no_sync is None:
            return None
        self._advance("read_gradients", what)
        return self._no_sync

    def next_collective_seq(self) -> int:
        """The number of this engine's next collective API call (checkpoints, 16-bit saves): every rank
        must reach the same number (comm/collective_check.py)."""
        self._collective_seq += 1
        return self._collective_seq

    def restore_counters(self, state: dict) -> None:
        """The step counters from a checkpoint's model state (absent ones are 0)."""
        for key in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
            setattr(self, key, state.get(key, 0))

    # -- offload_states bookkeeping (offload/states.py moves the tensors) --------------------------------

    def offloaded_kinds(self) -> FrozenSet:
        """The OffloadStateTypeEnum kinds parked in host memory now."""
        return frozenset(self._offloaded)

    def mark_offloaded(self, kind, parked: bool = True) -> None:
        (self._offloaded.add if parked else self._offloaded.discard)(kind)

    def empty_partition_cache(self) -> None:
        """Stage 3: releases every gathered parameter, persistent ones too (the next forward gathers
        them again). A no-op below stage 3, as in DeepSpeed."""
        if self.zero_model is not None:
            self.zero_model.release_all(include_persistent=True)

    # -- nn.Module --------------------------------------------------------------------------------------

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = super().__getattr__("module")
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"'{type(self).__name__}' object (nor its module "
                                     f"'{type(module).__name__}') has no attribute '{name}'") from None

    def forward(self, *args, **kwargs):
        self._require_alive("forward")
        self._require_loaded("forward", ("lp_params",))
        self.tput_timer.start()
        with self.wall_clock.phase("fwd"), autocast_if_enabled(self):  # (torch_autocast: precision/autocast.py)
            out = self.module(*args, **kwargs)
        if self.phase is StepPhase.FORWARD_ONLY or not torch.is_grad_enabled():  # no backward follows: the pass
            comm.settle()  # ends here ([Note: the exit race], comm/outstanding.py)
        else:
            self.direct_backward.watch(out)
        return out

    def _require_alive(self, what: str) -> None:
        """Nothing runs on a destroyed engine: its hooks, optimizer state and buffers are gone (a stage-3
        model is still partitioned, and would fail deep inside torch)."""
        if self.phase is StepPhase.DESTROYED:
            raise EngineUsageError(self._misuse(what, f"engine.{what}"))
        if self._failed is not None:
            raise EngineUsageError(f"engine.{what}: this engine cannot continue: {self._failed}")

    def _require_optimizer(self, what: str) -> None:
        if self.phase in (StepPhase.DESTROYED, StepPhase.FORWARD_ONLY):
            raise EngineUsageError(self._misuse(what, f"engine.{what}"))  # (the phase says why, whatever the call)
        self._require_alive(what)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside skip gradient reduction (DeepSpeed's API). Stages 0/1 reduce only at
        the step anyway; stages 2/3 reduce during backward into partitions and cannot defer it (for
        several backward passes with one reduction at any stage: coalesce_grad_reduction())."""
        if self.zero_optimization_stage() >= 2:
            raise EngineUsageError(f"engine.no_sync(): no_sync context manager is incompatible with ZeRO stage "
                                   f"{self.zero_optimization_stage()}: gradients are partitioned as they are produced "
                                   "(stages 0/1 only); engine.coalesce_grad_reduction() defers the reduction at every "
                                   "stage")
        if self._no_sync:  # (the inner block's exit would end the outer one)
            raise EngineUsageError(f"engine.no_sync(): no_sync context manager reentry is unsupported (already "
                                   f"inside engine.{self._no_sync}())")
        self._no_sync = "no_sync"
        try:
            yield
        finally:
            self._no_sync = None

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """A block of several backward passes whose gradients are reduced once, when it ends; the
        engine.step() after it applies them (DeepSpeed's API; optim/coalesce.py)."""
        check_coalesce(self, self._no_sync)
        self._require_optimizer("coalesce_grad_reduction")
        self._no_sync = "coalesce_grad_reduction"
        try:
            with deferred_reduction(self.zero_optimizer.reducer):
                yield
        finally:
            self._no_sync = None

    pipeline_parallelism = False  # DeepSpeed's flag: there is no pipeline engine here

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Changes the global batch by changing the accumulation steps (the micro batch stays)."""
        micro, world = self.train_micro_batch_size_per_gpu(), self.world_size
        if train_batch_size % (micro * world):
            raise ValueError(f"set_train_batch_size({train_batch_size}): not a multiple of micro batch {micro} x "
                             f"{world} ranks = {micro * world}")
        self._config.__dict__["gradient_accumulation_steps"] = train_batch_size // (micro * world)
        self._config.__dict__["train_batch_size"] = train_batch_size

    def _require_loaded(self, what: str, kinds=None) -> None:
        parked = sorted(k.value for k in self._offloaded if kinds is None or k.value in kinds)
        if parked:
            raise EngineUsageError(f"engine.{what}: {', '.join(parked)} are offloaded to host memory; call "
                               "engine.reload_states() first")

    # -- training ---------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagates ``loss`` divided by the accumulation steps (and, in fp16, multiplied by the
        loss scale); returns the loss divided by the accumulation steps."""
        with self.wall_clock.phase("bwd"):
            return self._backward(loss, retain_graph, scale_wrt_gas)

    def _backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool):
        self._require_optimizer("backward")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise TypeError(f"engine.backward expects the scalar loss tensor, got "
                            f"{type(loss).__name__}{'' if not torch.is_tensor(loss) else tuple(loss.shape)}")
        if loss.grad_fn is None:
            raise RuntimeError("engine.backward: the loss does not require grad (was it computed under "
                               "torch.no_grad(), or from frozen parameters only?)")
        self._require_loaded("backward", ("lp_params", "lp_grads"))
        if self.phase is StepPhase.REDUCED:
            self._advance("backward", "engine.backward")  # raises: the gradients are averaged already
        # (with accumulation, or a caller that sets the boundary itself as accelerate does, several backward
        # passes per step are the plan; at gradient_accumulation_steps 1 they are usually a missing step())
        if (self.phase is StepPhase.BACKWARD and not self._warned_second_backward
                and self.gradient_accumulation_steps() == 1 and self._is_gradient_accumulation_boundary is None
                and not self._no_sync and self.managed_gradient_accumulation()):
            self._warned_second_backward = True
            warnings.warn("engine.backward() was called again before engine.step() with gradient_accumulation_steps "
                          "1: the gradients of both backward passes are summed into one step. Call engine.step() "
                          "after each engine.backward(), or set gradient_accumulation_steps", RuntimeWarning,
                          stacklevel=2)
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            loss = loss / gas
        scale = self.zero_optimizer.cur_scale
        with self.wall_clock.phase("bwd_inner"), self.direct_backward.engine_backward():
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        self._advance("backward", "engine.backward")
        return loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's: the loss times the fp16 loss scale, for ``engine.scale(loss).backward()``."""
        return self.direct_backward.scale(loss)

    def _backward_epilogue(self) -> None:
        """DeepSpeed's: the end of a backward the engine did not run (through ``engine.module``): counted
        as ``engine.backward`` counts it, so that the next step() applies its gradients."""
        self.direct_backward.count("engine._backward_epilogue()", unscaled_is_error=False)

    def is_gradient_accumulation_boundary(self) -> bool:
        if not self.managed_gradient_accumulation():  # the caller's every step() is the boundary
            return True
        if self._is_gradient_accumulation_boundary is not None:
            return self._is_gradient_accumulation_boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        if not self.managed_gradient_accumulation():
            raise EngineUsageError("engine.set_gradient_accumulation_boundary(): with managed_gradient_accumulation "
                                   "false every step() is the boundary; there is nothing to set")
        self._is_gradient_accumulation_boundary = is_boundary

    def allreduce_gradients(self, bucket_size=None) -> None:
        """DeepSpeed's: average this step's gradients across the ranks now rather than in step() (then read
        them, e.g. ``optimizer.averaged_gradients``). Only at the accumulation boundary, as DeepSpeed does:
        stages 0/1 reduce there only, stages 2/3 have reduced each backward's gradients by its end.
        ``bucket_size``: accepted; ``reduce_bucket_size`` sizes the reduction."""
        if self.is_gradient_accumulation_boundary():
            self.gradients("engine.allreduce_gradients()")

    def step(self, lr_kwargs=None) -> None:
        """One micro step; at the accumulation boundary also the optimizer step."""
        steps = self.global_steps
        try:
            boundary = self.is_gradient_accumulation_boundary()
            with self.wall_clock.phase("step"):
                self._step(lr_kwargs)
            self.wall_clock.end_micro_step(self.global_steps > steps, self.global_steps)
            self.tput_timer.stop(global_step=boundary, report_speed=self.global_rank == 0)
        finally:  # the backend threads let go of this step's tensors ([Note: the exit race], comm/outstanding.py)
            comm.settle()

    def _step(self, lr_kwargs) -> None:
        self._require_optimizer("step")
        if self._no_sync:  # (DeepSpeed's message names no_sync for both blocks; so does ours)
            raise EngineUsageError(f"It is illegal to call Engine.step() inside no_sync context manager (here "
                                   f"engine.{self._no_sync}()): leave the block first (gradients are reduced after it)")
        self._require_loaded("step")  # (even with nothing to apply: the state it would step is parked)
        if self.phase not in (StepPhase.BACKWARD, StepPhase.REDUCED) and self.direct_backward.take_hand_set_gradients():
            self._advance("backward", "engine.step")  # (gradients assigned to .grad by the script: this step's)
        if self.phase not in (StepPhase.BACKWARD, StepPhase.REDUCED):
            self.direct_backward.refuse_outside_gradients()
            warnings.warn("engine.step() was called before engine.backward() in this micro step: "
                          "there are no gradients, so nothing was updated", RuntimeWarning, stacklevel=3)
            self._step_applied = False
            return
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            if self.world_size > 1:  # every rank takes this step, or all raise (optim/step_check.py)
                agree_on_step(self.global_steps, self.zero_optimizer.pg, self.device)
            try:
                self._step_applied = self.zero_optimizer.step()
            except OSError as exc:  # an NVMe write failed: undone on every rank (optim/nvme_step.py), or not
                nvme = self.zero_optimizer.nvme is not None or self.nvme_pieces is not None
                if nvme and not getattr(exc, "rolled_back", False):
                    self._failed = (f"step {self.global_steps + 1} could not write its state to NVMe ({exc}), so "
                                    "part of that step's model and optimizer state is lost. Free space under "
                                    "nvme_path (or fix the drive), then build a new engine and load the last "
                                    "checkpoint")
                raise
            self._advance("boundary_step", "engine.step")
            if self._step_applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
                logger.info("fp16 overflow: step %d skipped, loss scale now %g", self.global_steps,
                            self.zero_optimizer.cur_scale)
            # counted on skipped steps too, as DeepSpeed does
            self.global_steps += 1
            self.global_samples += self.train_batch_size() if self.managed_gradient_accumulation() else (
                self._backwards * self.train_micro_batch_size_per_gpu() * self.dp_world_size)  # (as many as ran)
            self._backwards = 0
        else:
            self._advance("micro_step", "engine.step")
        self.micro_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients accumulated since the last step."""
        if self.zero_optimizer is not None:
            self.zero_optimizer.zero_grad()
        if self.phase is not StepPhase.DESTROYED:
            self._advance("zero_grad", "engine.zero_grad")

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the parameters (False between boundaries and on overflow)."""
        return self._step_applied

    def get_wall_clock_timers(self) -> Dict[str, float]:
        """wall_clock_breakdown's timers (DeepSpeed's names, ms) as of the last step(); {} when off."""
        return self.wall_clock.snapshot()

    def get_global_grad_norm(self) -> Optional[float]:
        return self.zero_optimizer.global_grad_norm if self.zero_optimizer is not None else None

    def get_lr(self) -> List[float]:
        return [g.get("lr", 0.0) for g in self.zero_optimizer.param_groups] if self.zero_optimizer is not None else []

    def get_mom(self) -> List:
        if self.zero_optimizer is None:
            return []
        return [g.get("betas", g.get("momentum", 0.0)) for g in self.zero_optimizer.param_groups]

    # -- memory -----------------------------------------------------------------------------------------

    def memory_breakdown(self) -> Dict[str, Dict[str, int]]:
        """Bytes this rank holds, by kind and tier (docs/memory.md has the formulas). Kinds: params (the
        model's parameters in their dtype), fp32_master, grads (gradients in the model's dtype), fp32_grads
        (this rank's fp32 gradient partition), optimizer_state, comm_buffers, buffers (the module's buffers),
        hpz_secondary (ZeRO++ hpZ's node-local copies), activations (checkpointed calls' kept inputs).
        Tiers: accelerator (the compute device), host, nvme. A byte is counted once, under the first kind
        that holds it."""
        account = MemoryAccount(self.device, host=offload_state.offloaded_tensors(self) + self.host_placed())
        for kind, tensor in (self.zero_optimizer.tensors() if self.zero_optimizer is not None else []):
            account.add(kind, tensor)
        for p in self.module.parameters():
            account.add("params", p.data)  # stage 3: the full value while gathered, else nothing
            shard = getattr(p, "ds_tensor", None)
            if shard is not None:
                account.add("params", shard)  # stage 3: this rank's piece (frozen parameters' too)
            if p.grad is not None:
                account.add("grads", p.grad)
        for b in self.module.buffers():
            account.add("buffers", b)
        if self.zero_model is not None and self.zero_model.secondary is not None:
            for t in self.zero_model.secondary.tensors():  # ZeRO++ hpZ's node-local copies
                account.add("hpz_secondary", t)
        if self.zero_model is not None and self.zero_model.frozen_pieces is not None:
            for t in self.zero_model.frozen_pieces.tensors():  # frozen pieces kept as int8 and scales
                account.add("params", t)
        for t, tier in activation_checkpointing.held():
            account.add("activations", t, tier=tier)
        if self.zero_optimizer is not None and self.zero_optimizer.nvme is not None:
            masters, states = self.zero_optimizer.nvme_bytes()
            account.bytes["fp32_master"]["nvme"] += masters
            account.bytes["optimizer_state"]["nvme"] += states
            account.bytes["comm_buffers"]["host"] += self.zero_optimizer.nvme.host_bytes()  # the swap buffers
        # the native transport's shared slots, this rank's share (docs/memory.md): host memory, which
        # on a CPU run is the compute device's
        account.bytes["comm_buffers"]["accelerator" if self.device.type == "cpu" else "host"] += \
            comm.native.buffer_bytes()
        account.bytes["comm_buffers"]["accelerator"] += comm.nccl.buffer_bytes()  # NCCL's own, on the GPU
        for pieces in self._piece_stores():
            account.bytes["params"]["nvme"] += pieces.nvme_bytes()
            for t in pieces.cached_tensors():  # (max_in_cpu's host copies)
                account.add("params", t, tier="host")
            account.bytes["comm_buffers"]["host"] += pieces.store.host_bytes()
        return account.table()

    def _piece_stores(self):
        """The NVMe stores holding this model's pieces: the engine's, and zero.Init's for pieces it kept."""
        if self.nvme_pieces is None:
            return []
        stores = {id(self.nvme_pieces): self.nvme_pieces}
        for zp in map(zero_param_of, self.module.parameters()):
            if zp is not None and zp.piece_io is not None:
                stores.setdefault(id(zp.piece_io), zp.piece_io)
        return list(stores.values())

    def _state_in_memory(self, modified: bool):
        """NVMe offload: masters, optimizer state and 16-bit pieces in memory for a checkpoint
        (ZeroOptimizer.materialized)."""
        if self.zero_optimizer is not None:
            return self.zero_optimizer.materialized(modified=modified)
        if self.nvme_pieces is not None:
            return self.nvme_pieces.materialized(modified)
        return contextlib.nullcontext()

    def host_placed(self) -> List[torch.Tensor]:
        """Tensors the offload config keeps in host memory: the offloaded optimizer's masters, gradient
        partitions and state; with offload_param the parameter pieces."""
        out = self.zero_optimizer.host_tensors() if self.zero_optimizer is not None else []
        if self.offload.params:
            out += [p.ds_tensor for p in self.module.parameters() if getattr(p, "ds_tensor", None) is not None]
            out += [g.flat for g in (self.zero_optimizer.flat_groups if self.zero_optimizer is not None else [])]
        return out

    # -- checkpoints (save/load/wait: checkpoint/engine_api.py) -----------------------------------------------

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The model's weights in their training dtype, whole (stage 3: gathered; collective there; with
        MoE layers rank 0 gets every expert under its global name, checkpoint/experts.py)."""
        if self.zero_model is not None:
            with GatheredParameters(list(self.module.parameters())):
                sd = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        else:
            sd = self.module.state_dict()
        if getattr(self, "has_moe_layers", False) and comm.get_world_size() > 1:  # every expert, on rank 0
            sd = with_every_expert(self.module, sd)
        if exclude_frozen_parameters:
            for n, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(n, None)
        return sd

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective; rank 0 writes the weights (safetensors when the file name ends so)."""
        self._require_alive("save_16bit_model")
        check_all_ranks_call("save_16bit_model", self.next_collective_seq())
        zc = self._config.zero_optimization
        if zc.stage == 3 and not zc.gather_16bit_weights_on_model_save:
            logger.warning("save_16bit_model: ZeRO-3 weights are partitioned; set "
                           "zero_optimization.gather_16bit_weights_on_model_save (or its stage3_ alias) to true "
                           "to gather and save them. Nothing was saved.")
            return False
        sd = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            if save_filename.endswith(".safetensors"):
                from safetensors.torch import save_file  # optional: only for .safetensors file names

                save_file({k: v.detach().contiguous().clone().cpu() for k, v in sd.items()}, path,
                          metadata={"format": "pt"})
            else:
                atomic_torch_save({k: v.detach().cpu() for k, v in sd.items()}, path)
        if self.world_size > 1:
            comm.barrier()
        return True

    save_fp16_model = save_16bit_model

    # -- offload_states / reload_states (offload/states.py) ----------------------------------------------

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Moves the chosen kinds of state (OffloadStateTypeEnum; default all) to host memory."""
        self._require_optimizer("offload_states")
        offload_state.offload_states(self, include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Brings every offloaded state back to the compute device, bit for bit."""
        self._require_alive("reload_states")
        offload_state.reload_states(self, non_blocking)

    def destroy(self) -> None:
        """Removes every hook the engine installed (stage 2 gradient hooks; stage 3 module hooks), removes
        NVMe swap files, and frees the optimizer's state, gradient partitions and buffers even while the
        engine object is still referenced. The module keeps its trained weights: stages 0-2 as plain
        parameters; stage 3 partitioned (as in DeepSpeed: read them under GatheredParameters, or make them
        whole with zero_ext.zero.unpartition). backward()/step() afterwards are errors."""
        if self.zero_optimizer is not None:
            self.zero_optimizer.reducer.remove_hooks()
            self.zero_optimizer.destroy_offload()
            self.zero_optimizer.release()
            take_back(self.zero_optimizer.optimizer)
        if self.nvme_pieces is not None:  # the model keeps its weights: pieces back in host memory first
            for pieces in self._piece_stores():  # (zero.Init's own store holds the pieces it wrote and kept)
                pieces.bring_home()
            self.nvme_pieces = None
        if self.zero_model is not None:
            self.zero_model.destroy()
            self.zero_model = None
        comm.drain()  # nothing of this engine's collectives left with the backend ([Note: the exit race])
        self._advance("destroy", "engine.destroy")
        publish.wait()  # rank 0: a save still being published ends first (its failure is raised here)
