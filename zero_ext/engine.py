"""The training engine: DeepSpeed's ``DeepSpeedEngine`` surface over ZeRO stages 0-2.

    engine, optimizer, loader, scheduler = zero_ext.initialize(model=model, config=cfg)
    loss = engine(batch); engine.backward(loss); engine.step()

The engine wraps the user's module (``engine.module``; unknown attributes are forwarded to it), owns
the ZeRO optimizer (zero_optimizer.py) and counts steps. ``step()`` updates only at the accumulation
boundary, every ``gradient_accumulation_steps`` micro steps.
"""
import contextlib
import logging
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import comm
from .optim.flat_group import FlatGroup
from .optim.grad_reduce import Averaging, BoundaryReducer, BucketReducer
from .optim.loss_scaler import scaler_from_config
from .offload.memory import MemoryAccount
from .offload.plan import OffloadPlan
from .optim.zero_optimizer import ZeroOptimizer

logger = logging.getLogger("zero_ext.engine")

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class ZeroEngine(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, config, base_optimizer: torch.optim.Optimizer,
                 lr_scheduler=None, training_dataloader=None, device: Optional[torch.device] = None,
                 zero_model=None):
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
        self.skipped_steps = 0
        self._step_applied = False
        self._backward_since_step = False
        self._boundary_override: Optional[bool] = None
        self._collective_seq = 0  # counts collective calls, so a rank that skips one is detected
        self._offloaded = set()  # OffloadStateTypeEnum kinds parked in host memory (offload_states.py)
        self._no_sync = False
        self.offload = OffloadPlan(config.zero_optimization)  # ZeRO-Offload placement (offload.py)
        self.training_dataloader = training_dataloader
        self.optimizer = None  # a forward-only engine has none (initialize without an optimizer)
        self.nvme_pieces = None  # offload_param nvme (nvme_params.py): opened before the sub-groups are made
        if self.offload.param_device == "nvme":
            self.nvme_pieces = self._open_nvme_pieces(base_optimizer is not None)
        if base_optimizer is not None:
            self.optimizer = self._build_zero_optimizer(base_optimizer)
            self.optimizer.at_boundary = self.is_gradient_accumulation_boundary
            if self.offload.optimizer_device == "nvme":
                self._attach_nvme()
        if self.nvme_pieces is not None:
            self._attach_other_pieces()
        self.lr_scheduler = lr_scheduler

    # -- construction ---------------------------------------------------------------------------------

    def _build_zero_optimizer(self, base: torch.optim.Optimizer) -> ZeroOptimizer:
        zc = self._config.zero_optimization
        stage = zc.stage
        if stage == 3:
            return self._build_stage3_optimizer(base)
        host = self.offload.host if self.offload.optimizer else None
        groups: List[Optional[FlatGroup]] = []
        for group in base.param_groups:
            trainable = [p for p in group["params"] if p.requires_grad]
            if not trainable:
                groups.append(None)
                group["params"] = []
                continue
            g = FlatGroup(trainable, self.world_size, self.global_rank, partitioned=stage >= 1,
                          keep_lp_grads=stage < 2, device=self.device, host=host)
            group["params"] = [g.master]
            groups.append(g)
        flat = [g for g in groups if g is not None]
        cfg = self._config
        comm_dtype = _DTYPES.get(cfg.communication_data_type, flat[0].dtype)
        averaging = Averaging(self.world_size, comm_dtype, cfg.prescale_gradients, cfg.gradient_predivide_factor)
        if stage == 2:
            reducer = BucketReducer(flat, zc.reduce_bucket_size, zc.overlap_comm, zc.contiguous_gradients,
                                    self.global_rank, self.world_size, zc.ignore_unused_parameters, averaging)
        else:
            reducer = BoundaryReducer(flat, zc.reduce_bucket_size, averaging)
        return ZeroOptimizer(base, groups, reducer, stage, cfg.gradient_clipping, zc.allgather_bucket_size,
                             self.global_rank, self.world_size, loss_scaler=scaler_from_config(cfg.fp16))

    def _averaging(self, model_dtype: torch.dtype) -> Averaging:
        cfg = self._config
        comm_dtype = _DTYPES.get(cfg.communication_data_type, model_dtype)
        return Averaging(self.world_size, comm_dtype, cfg.prescale_gradients, cfg.gradient_predivide_factor)

    def _build_stage3_optimizer(self, base: torch.optim.Optimizer) -> ZeroOptimizer:
        from .optim.shard_groups import ShardReducer, build_shard_groups

        cfg, zc = self._config, self._config.zero_optimization
        on_group = self._register_piece_group if self.nvme_pieces is not None else None
        _, groups = build_shard_groups(base, self.zero_model, zc.sub_group_size, self.global_rank, self.world_size,
                                       plan=self.offload, on_group=on_group)
        reducer = ShardReducer(groups, self.zero_model, zc.reduce_bucket_size, zc.overlap_comm,
                               self._averaging(groups[0].dtype), self.global_rank, self.world_size,
                               zc.ignore_unused_parameters)
        opt = ZeroOptimizer(base, groups, reducer, 3, cfg.gradient_clipping, zc.allgather_bucket_size,
                            self.global_rank, self.world_size, loss_scaler=scaler_from_config(cfg.fp16))
        opt.after_step_hooks.append(self.zero_model.refresh_persistent)
        return opt

    def _attach_nvme(self) -> None:
        """offload_optimizer.device = "nvme": masters and optimizer state go to swap files under nvme_path,
        one file per sub-group of sub_group_size elements, streamed through buffer_count host buffers."""
        from .nvme.swap_dir import check_nvme_path
        from .nvme.store import NVMeStateStore

        oc = self._config.zero_optimization.offload_optimizer
        # before any training: the directory works and has room for this rank's files (plus the padding
        # of each file to a page)
        opt = self.optimizer
        need = sum(opt.nvme_file_bytes(g) + 4096 for g in opt.flat_groups)
        check_nvme_path(oc.nvme_path, need)
        # No more buffers than groups: each buffer in use holds a different group, so a larger pool would
        # only keep copies (a stage-1/2 partition within sub_group_size is one group).
        sub_group_size = self._config.zero_optimization.sub_group_size
        groups = sum(len(opt.nvme_slices(g, sub_group_size)) for g in opt.flat_groups)
        count = max(1, min(oc.buffer_count, groups))
        store = NVMeStateStore(oc.nvme_path, count, aio=self._config.aio, pin_memory=oc.pin_memory)
        self.optimizer.attach_nvme(store, oc.pipeline_read, oc.pipeline_write, oc.fast_init, sub_group_size)

    def _open_nvme_pieces(self, has_optimizer: bool):
        """offload_param.device = "nvme" (stage 3): the 16-bit pieces go to swap files under its nvme_path —
        one file per optimizer sub-group's piece buffer, written as the sub-group is made, and one per other
        piece (frozen parameters, every piece of a forward-only engine) — and are read through buffer_count
        host buffers when used. Pieces zero.Init(remote_device="nvme") already wrote stay in its files."""
        from .nvme.swap_dir import check_nvme_path
        from .config import ConfigError
        from .nvme.pieces import NVMePieces
        from .nvme.store import NVMeStateStore
        from .zero.param import zero_param_of

        pc = self._config.zero_optimization.offload_param
        if has_optimizer and (not self.offload.optimizer or self.offload.ratio < 1.0):
            raise ConfigError('zero_optimization.offload_param.device = "nvme" needs the optimizer offloaded whole: '
                              'set offload_optimizer.device to "cpu" or "nvme" (and ratio 1)')
        zps = list({id(z): z for z in map(zero_param_of, self.module.parameters()) if z}.values())
        elem = next(iter(self.module.parameters())).element_size()
        check_nvme_path(pc.nvme_path, sum(zp.shard_numel * elem + 4096 for zp in zps))
        store = NVMeStateStore(pc.nvme_path, pc.buffer_count, aio=self._config.aio, pin_memory=pc.pin_memory)
        return NVMePieces(store, pc.max_in_cpu)

    def _register_piece_group(self, k: int, g) -> None:
        """build_shard_groups' callback: sub-group k's piece buffer to its swap file, its host memory freed."""
        from .config import ConfigError

        pc = self._config.zero_optimization.offload_param
        if g.flat.numel() > pc.buffer_size:
            raise ConfigError(f"zero_optimization.offload_param.buffer_size = {pc.buffer_size} elements is smaller "
                              f"than sub-group {k}'s pieces ({g.flat.numel()} elements): raise buffer_size, or "
                              "lower zero_optimization.sub_group_size")
        self.nvme_pieces.add_buffer(("lp", k), g.flat, list(zip(g.zparams, g.offsets, g.shards)))

    def _piece_stores(self):
        """The NVMe stores holding this model's pieces: the engine's, and zero.Init's for pieces it kept."""
        if self.nvme_pieces is None:
            return []
        from .zero.param import zero_param_of

        stores = {id(self.nvme_pieces): self.nvme_pieces}
        for zp in map(zero_param_of, self.module.parameters()):
            if zp is not None and zp.piece_io is not None:
                stores.setdefault(id(zp.piece_io), zp.piece_io)
        return list(stores.values())

    def _attach_other_pieces(self) -> None:
        """The pieces no sub-group holds (frozen; all of a forward-only engine), unless zero.Init put them
        on NVMe already; then the optimizer learns where its pieces are."""
        from .zero.param import zero_param_of

        for zp in {id(z): z for z in map(zero_param_of, self.module.parameters()) if z}.values():
            if zp.piece_io is None and id(zp) not in self.nvme_pieces._key_of:
                self.nvme_pieces.add_piece(("piece", zp.ds_id), zp)
        if self.optimizer is not None:
            self.optimizer.nvme_pieces = self.nvme_pieces

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
        self._require_loaded("forward", ("lp_params",))
        return self.module(*args, **kwargs)

    def _require_optimizer(self, what: str) -> None:
        if getattr(self, "_destroyed", False):
            raise RuntimeError(f"engine.{what}: this engine was destroyed (engine.destroy()); build a new one with "
                               "zero_ext.initialize")
        if self.optimizer is None:
            raise RuntimeError(f"engine.{what}: this engine has no optimizer (initialize was given none and the "
                               "config has no 'optimizer' section): it runs forward only")

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside skip gradient reduction (DeepSpeed's API). Stages 0/1 reduce only at
        the step anyway; stages 2/3 reduce during backward into partitions and cannot defer it."""
        if self.zero_optimization_stage() >= 2:
            raise RuntimeError(f"engine.no_sync() is incompatible with ZeRO stage {self.zero_optimization_stage()}: "
                               "gradients are partitioned as they are produced (as in DeepSpeed, stages 0/1 only)")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

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
            raise RuntimeError(f"engine.{what}: {', '.join(parked)} are offloaded to host memory; call "
                               "engine.reload_states() first")

    # -- training ---------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagates ``loss`` divided by the accumulation steps (and, in fp16, multiplied by the
        loss scale); returns the loss divided by the accumulation steps."""
        self._require_optimizer("backward")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise TypeError(f"engine.backward expects the scalar loss tensor, got "
                            f"{type(loss).__name__}{'' if not torch.is_tensor(loss) else tuple(loss.shape)}")
        if loss.grad_fn is None:
            raise RuntimeError("engine.backward: the loss does not require grad (was it computed under "
                               "torch.no_grad(), or from frozen parameters only?)")
        self._require_loaded("backward", ("lp_params", "lp_grads"))
        if self.optimizer.reduced and self.zero_optimization_stage() < 2:
            raise RuntimeError("engine.backward: this step's gradients were already averaged across ranks (a "
                               "safe_get/safe_set gradient call); call engine.step() before the next backward")
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            loss = loss / gas
        scale = self.optimizer.cur_scale
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        self._backward_since_step = True
        self.optimizer.grads_valid = True
        return loss

    def _refuse_gradients_from_outside_backward(self) -> None:
        """step() without engine.backward(): an error if gradients are there anyway, i.e. the script
        called ``loss.backward()`` itself (unscaled for accumulation and fp16, and uncounted). Collective:
        every rank reaches this step() the same way, and all must agree to raise."""
        if self.optimizer.grads_valid:  # engine.backward() ran earlier in this accumulation: its gradients
            return
        groups = self.optimizer.flat_groups
        found = any(t is not None and bool(t.any()) for g in groups for t in (getattr(g, "lp_grad", None), g.grad))
        if self.world_size > 1:
            flag = torch.tensor([1.0 if found else 0.0], device=self.device)  # (offloaded grads live on the host)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            found = bool(flag.item())
        if found:
            raise RuntimeError("engine.step(): the parameters have gradients, but engine.backward() was not called "
                               "since the last step: call engine.backward(loss) instead of loss.backward(). The "
                               "engine scales the loss for gradient accumulation (and fp16) and counts the micro step "
                               "there; gradients from a plain loss.backward() would be applied wrongly")

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary

    def step(self, lr_kwargs=None) -> None:
        """One micro step; at the accumulation boundary also the optimizer step."""
        self._require_optimizer("step")
        if self._no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): leave the no_sync() block first (gradients "
                               "must be reduced before a step)")
        if not self._backward_since_step:
            self._refuse_gradients_from_outside_backward()
            warnings.warn("engine.step() was called before engine.backward() in this micro step: "
                          "there are no gradients, so nothing was updated", RuntimeWarning, stacklevel=2)
            self._step_applied = False
            return
        self._backward_since_step = False
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._require_loaded("step")
            self._step_applied = self.optimizer.step()
            if self._step_applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
                logger.info("fp16 overflow: step %d skipped, loss scale now %g", self.global_steps,
                            self.optimizer.cur_scale)
            # counted on skipped steps too, as DeepSpeed does
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.micro_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients accumulated since the last step."""
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the parameters (False between boundaries and on overflow)."""
        return self._step_applied

    def get_global_grad_norm(self) -> Optional[float]:
        return self.optimizer.global_grad_norm if self.optimizer is not None else None

    def get_lr(self) -> List[float]:
        return [g.get("lr", 0.0) for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_mom(self) -> List:
        if self.optimizer is None:
            return []
        return [g.get("betas", g.get("momentum", 0.0)) for g in self.optimizer.param_groups]

    # -- config accessors -------------------------------------------------------------------------------

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def get_batch_info(self):
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self._config.zero_optimization.stage > 0

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def zero_optimization_partition_weights(self) -> bool:
        """Whether the parameters are partitioned (stage 3)."""
        return self.zero_optimization_stage() >= 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.gather_16bit_weights_on_model_save: whether a 16-bit save of a ZeRO-3 model
        gathers the weights (accelerate asks before calling _zero3_consolidated_16bit_state_dict)."""
        return self._config.zero_optimization.gather_16bit_weights_on_model_save

    @property
    def config(self):
        return self._config

    # -- memory -----------------------------------------------------------------------------------------

    def memory_breakdown(self) -> Dict[str, Dict[str, int]]:
        """Bytes this rank holds, by kind and tier (see docs/memory.md for the formulas).

        Kinds: params (the model's parameters in their dtype), fp32_master, grads (gradients in the
        model's dtype), fp32_grads (this rank's fp32 gradient partition), optimizer_state,
        comm_buffers, buffers (the module's buffers). Tiers: accelerator (the compute device), host,
        nvme. A byte is counted once, under the first kind that holds it: an fp32 master that is a
        view of the parameters adds nothing.
        """
        from .offload.states import offloaded_tensors

        account = MemoryAccount(self.device, host=offloaded_tensors(self) + self._host_placed())
        for kind, tensor in (self.optimizer.tensors() if self.optimizer is not None else []):
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
        if self.optimizer is not None and self.optimizer.nvme is not None:
            masters, states = self.optimizer.nvme_bytes()
            account.bytes["fp32_master"]["nvme"] += masters
            account.bytes["optimizer_state"]["nvme"] += states
            account.bytes["comm_buffers"]["host"] += self.optimizer.nvme.host_bytes()  # the swap buffers
        for pieces in self._piece_stores():
            account.bytes["params"]["nvme"] += pieces.nvme_bytes()
            for t in pieces.cached_tensors():  # (max_in_cpu's host copies)
                account.add("params", t, tier="host")
            account.bytes["comm_buffers"]["host"] += pieces.store.host_bytes()
        return account.table()

    def _state_in_memory(self, modified: bool):
        """NVMe offload: masters, optimizer state and 16-bit pieces in memory for a checkpoint
        (ZeroOptimizer.materialized)."""
        if self.optimizer is not None:
            return self.optimizer.materialized(modified=modified)
        if self.nvme_pieces is not None:
            return self.nvme_pieces.materialized(modified)
        return contextlib.nullcontext()

    def _host_placed(self) -> List[torch.Tensor]:
        """Tensors the offload config keeps in host memory: the offloaded optimizer's masters, gradient
        partitions and state; with offload_param the parameter pieces."""
        out = self.optimizer.host_tensors() if self.optimizer is not None else []
        if self.offload.params:
            out += [p.ds_tensor for p in self.module.parameters() if getattr(p, "ds_tensor", None) is not None]
            out += [g.flat for g in (self.optimizer.flat_groups if self.optimizer is not None else [])]
        return out

    # -- checkpoints (checkpoint.py) -------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Collective: every rank writes its shard; see docs/checkpoints.md."""
        from .checkpoint.engine_state import save_checkpoint

        with self._state_in_memory(modified=False):
            return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Collective. Returns (load_path, client_state), or (None, None) when there is nothing to load."""
        from .checkpoint.engine_state import load_checkpoint

        with self._state_in_memory(modified=True):
            return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                   load_lr_scheduler_states, load_module_only, custom_load_fn)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The model's weights in their training dtype, whole (stage 3: gathered; collective there)."""
        if self.zero_model is not None:
            from .zero import GatheredParameters

            with GatheredParameters(list(self.module.parameters())):
                sd = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        else:
            sd = self.module.state_dict()
        if exclude_frozen_parameters:
            for n, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(n, None)
        return sd

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective; rank 0 writes the weights (safetensors when the file name ends so)."""
        from .checkpoint.engine_state import check_all_ranks_call
        from .checkpoint.files import atomic_torch_save

        self._collective_seq += 1
        check_all_ranks_call("save_16bit_model", self._collective_seq)
        zc = self._config.zero_optimization
        if zc.stage == 3 and not zc.gather_16bit_weights_on_model_save:
            logger.warning("save_16bit_model: ZeRO-3 weights are partitioned; set "
                           "zero_optimization.gather_16bit_weights_on_model_save (or its stage3_ alias) to true "
                           "to gather and save them. Nothing was saved.")
            return False
        sd = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.global_rank == 0:
            import os

            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            if save_filename.endswith(".safetensors"):
                from safetensors.torch import save_file

                save_file({k: v.detach().contiguous().clone().cpu() for k, v in sd.items()}, path,
                          metadata={"format": "pt"})
            else:
                atomic_torch_save({k: v.detach().cpu() for k, v in sd.items()}, path)
        if self.world_size > 1:
            dist.barrier()
        return True

    save_fp16_model = save_16bit_model

    # -- offload_states / reload_states (offload_states.py) ----------------------------------------------

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Moves the chosen kinds of state (OffloadStateTypeEnum; default all) to host memory."""
        from .offload.states import offload_states

        offload_states(self, include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Brings every offloaded state back to the compute device, bit for bit."""
        from .offload.states import reload_states

        reload_states(self, non_blocking)

    def destroy(self) -> None:
        """Removes every hook the engine installed (stage 2 gradient hooks; stage 3 module hooks), removes
        NVMe swap files, and frees the optimizer's state, gradient partitions and buffers even while the
        engine object is still referenced. The module keeps its trained weights: stages 0-2 as plain
        parameters; stage 3 partitioned (as in DeepSpeed: read them under GatheredParameters, or make them
        whole with zero_ext.zero.unpartition). backward()/step() afterwards are errors."""
        remove = getattr(getattr(self.optimizer, "reducer", None), "remove_hooks", None)
        if remove:
            remove()
        if self.optimizer is not None:
            self.optimizer.destroy_offload()
            self.optimizer.release()
        if self.nvme_pieces is not None:  # the model keeps its weights: pieces back in host memory first
            for pieces in self._piece_stores():  # (zero.Init's own store holds the pieces it wrote and kept)
                pieces.bring_home()
            self.nvme_pieces = None
        if self.zero_model is not None:
            self.zero_model.destroy()
            self.zero_model = None
        self._destroyed = True
