"""save_checkpoint / load_checkpoint for ZeRO stages 0-2 (DeepSpeed's folder layout and key names).

    <save_dir>/latest                                      the tag, written last (rank 0)
    <save_dir>/zero_to_fp32.py                             standalone converter (needs only torch)
    <save_dir>/<tag>/mp_rank_00_model_states.pt            module, counters, scheduler, client state (rank 0)
    <save_dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r's fp32 partitions,
                                                           optimizer state, loss scaler, RNG states
    <save_dir>/<tag>/zero_ext_manifest.json                sha256 and size of every file, the layout

Loading reshards: the fp32 partitions and the element-wise optimizer state of every group are laid out
flat (csrc/partition.c), so a checkpoint saved by W ranks at any stage is rebuilt into full flat
tensors and cut again for the N ranks (and stage) loading it. See docs/checkpoints.md.
"""
import json
import logging
import os
import random
import shutil
import time
import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .checkpoint_io import (FORMAT_VERSION, MANIFEST, CheckpointError, atomic_torch_save, atomic_write_bytes,
                            read_manifest, verified_load)

logger = logging.getLogger("zero_ext.checkpoint")

MODEL_FILE = "mp_rank_00_model_states.pt"
STANDARD_KEYS = {"module", "buffer_names", "param_shapes", "frozen_param_shapes", "shared_params", "lr_scheduler",
                 "global_steps", "global_samples", "skipped_steps", "micro_steps", "dp_world_size", "mp_world_size",
                 "ds_config", "ds_version", "zero_stage", "optimizer", "checkpoint_parallel_dimensions"}

def _collective_timeout() -> float:
    """Seconds a rank waits for the others to enter a checkpoint call (ZERO_EXT_COLLECTIVE_CHECK_TIMEOUT)."""
    return float(os.environ.get("ZERO_EXT_COLLECTIVE_CHECK_TIMEOUT", "120"))


def optim_file(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _refuse_stage3(engine, what: str) -> None:
    if engine.config.zero_optimization.stage == 3:
        raise NotImplementedError(f"{what}: ZeRO stage 3 checkpoints are not implemented by zero_ext yet (stages "
                                  "0-2 are); save_16bit_model() exports the weights meanwhile")


# -- every rank must call ---------------------------------------------------------------------------------

def check_all_ranks_call(what: str, seq: int, timeout: float = None) -> None:
    """Fails (instead of hanging in the collectives that follow) when some rank does not call `what`:
    each rank counts itself in on the process group's store and waits for the others."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    timeout = _collective_timeout() if timeout is None else timeout
    store = dist.distributed_c10d._get_default_store()
    key = f"zero_ext/collective/{what}/{seq}"
    world = dist.get_world_size()
    arrived = store.add(key, 1)
    deadline = time.monotonic() + timeout
    while arrived < world:
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{what} is collective, but only {arrived} of {world} ranks called it within {timeout:.0f}s: call "
                f"it on every rank (not under `if rank == 0:`); every rank writes its own shard")
        time.sleep(0.01)
        arrived = store.add(key, 0)


# -- layout helpers ---------------------------------------------------------------------------------------

def _param_names(module: torch.nn.Module) -> Dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _shared_params(module: torch.nn.Module) -> Dict[str, str]:
    """alias name -> the name state_dict keeps first, for tied parameters."""
    first, shared = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shared[name] = first[id(p)]
        else:
            first[id(p)] = name
    return shared


def _rng_state() -> Dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]) + [random.getstate()[2]],
             "python_version": random.getstate()[0],
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((state["python_version"], tuple(py[:-1]), py[-1]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- save -------------------------------------------------------------------------------------------------

def save_checkpoint(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    if not save_dir:
        raise ValueError("save_checkpoint: save_dir is empty; give the folder to save into")
    _refuse_stage3(engine, "save_checkpoint")
    engine._collective_seq += 1
    check_all_ranks_call("save_checkpoint", engine._collective_seq)
    rank, world = engine.global_rank, engine.world_size
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    _validate_tag(engine, tag)
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    opt, cfg = engine.optimizer, engine.config
    stage = cfg.zero_optimization.stage
    bf16 = cfg.bf16.enabled
    digests = {}
    writes_optim = stage >= 1 or rank == 0  # stage 0 replicates: rank 0's copy is the whole state
    if writes_optim:
        name = optim_file(rank, bf16)
        digests[name] = atomic_torch_save(_optim_state(engine), os.path.join(tag_dir, name))
    if rank == 0:
        state = _model_state(engine, exclude_frozen_parameters)
        for key, value in (client_state or {}).items():
            if key in STANDARD_KEYS:
                raise KeyError(f"save_checkpoint: client_state key {key!r} is reserved by the checkpoint format")
            state[key] = value
        digests[MODEL_FILE] = atomic_torch_save(state, os.path.join(tag_dir, MODEL_FILE))
    gathered = [None] * world if rank == 0 else None
    if world > 1:
        dist.gather_object(digests, gathered, dst=0)
    else:
        gathered = [digests]
    if rank == 0:
        files = {k: v for d in gathered for k, v in d.items()}
        manifest = {"format_version": FORMAT_VERSION, "tag": tag, "world_size": world, "zero_stage": stage,
                    "layout_world": world if stage >= 1 else 1, "bf16": bf16,
                    "groups": [g.numels for g in opt.flat_groups], "files": files}
        atomic_write_bytes(os.path.join(tag_dir, MANIFEST), json.dumps(manifest, indent=1).encode())
        shutil.copyfile(os.path.join(os.path.dirname(__file__), "zero_to_fp32.py"),
                        os.path.join(save_dir, "zero_to_fp32.py"))
        if save_latest:
            atomic_write_bytes(os.path.join(save_dir, "latest"), tag.encode())
    if world > 1:
        dist.barrier()
    return True


def _validate_tag(engine, tag: str) -> None:
    mode = engine.config.checkpoint.tag_validation
    if mode == "IGNORE" or engine.world_size == 1:
        return
    tags = [None] * engine.world_size
    dist.all_gather_object(tags, tag)
    if len(set(tags)) > 1:
        msg = f"checkpoint tags differ across ranks: {tags}; pass the same tag on every rank"
        if mode == "FAIL":
            raise CheckpointError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _model_state(engine, exclude_frozen: bool) -> Dict[str, Any]:
    module, opt = engine.module, engine.optimizer
    names = _param_names(module)
    sd = module.state_dict()
    if exclude_frozen:
        for n, p in module.named_parameters():
            if not p.requires_grad:
                sd.pop(n, None)
    return {
        "module": sd,
        "buffer_names": [n for n, _ in module.named_buffers()],
        "param_shapes": [OrderedDict((names[id(p)], list(p.shape)) for p in g.params) for g in opt.flat_groups],
        "frozen_param_shapes": OrderedDict((n, list(p.shape)) for n, p in module.named_parameters()
                                           if not p.requires_grad),
        "shared_params": _shared_params(module),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
        "dp_world_size": engine.world_size, "mp_world_size": 1, "zero_stage": engine.config.zero_optimization.stage,
        "ds_config": engine.config.raw, "ds_version": f"zero_ext-{_version()}", "optimizer": None,
    }


def _optim_state(engine) -> Dict[str, Any]:
    opt = engine.optimizer
    scaler = opt.loss_scaler
    return {
        "optimizer_state_dict": {
            "zero_stage": engine.config.zero_optimization.stage,
            "loss_scaler": scaler.state_dict(), "dynamic_loss_scale": scaler.dynamic, "overflow": opt.overflow,
            "clip_grad": opt.clip, "base_optimizer_state": opt.optimizer.state_dict(),
            "single_partition_of_fp32_groups": [g.master.detach().clone() for g in opt.flat_groups],
            "partition_count": opt.flat_groups[0].world if opt.flat_groups[0].partitioned else 1,
            "group_numels": [g.numels for g in opt.flat_groups],
            "group_padded": [g.padded for g in opt.flat_groups],
        },
        "rng": _rng_state(),
        "ds_version": f"zero_ext-{_version()}",
    }


def _version() -> str:
    from . import __version__

    return __version__


# -- load -------------------------------------------------------------------------------------------------

def load_checkpoint(engine, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn=None) -> Tuple[Optional[str], Optional[dict]]:
    if custom_load_fn is not None:
        raise ValueError("load_checkpoint: custom_load_fn is not supported by zero_ext")
    _refuse_stage3(engine, "load_checkpoint")
    engine._collective_seq += 1
    check_all_ranks_call("load_checkpoint", engine._collective_seq)
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.exists(latest):
            warnings.warn(f"load_checkpoint: no 'latest' file in {load_dir} and no tag given; nothing loaded",
                          RuntimeWarning, stacklevel=3)
            return None, None
        with open(latest) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(load_dir, str(tag))
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"checkpoint folder {tag_dir} does not exist")
    manifest = read_manifest(tag_dir)
    state = verified_load(tag_dir, MODEL_FILE, manifest)
    _load_module(engine, state, load_module_strict)
    opt = engine.optimizer
    if load_optimizer_states and not load_module_only:
        _check_layout(engine, manifest, state, tag_dir)
        _load_optimizer(engine, tag_dir, manifest)
    else:
        for g in opt.flat_groups:  # rebuild the fp32 masters from the loaded weights, as DeepSpeed does
            with torch.no_grad():
                g.master.copy_(g.flat[g.lo:g.hi])
    if not load_module_only:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for key in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
            setattr(engine, key, state.get(key, 0))
    opt._end_of_step()  # no gradients carry over a load
    client_state = {k: v for k, v in state.items() if k not in STANDARD_KEYS}
    if engine.world_size > 1:
        dist.barrier()
    return tag_dir, client_state


def _load_module(engine, state: Dict[str, Any], strict: bool) -> None:
    sd = state["module"]
    device = engine.device
    with torch.no_grad():
        missing, unexpected = engine.module.load_state_dict({k: v.to(device) for k, v in sd.items()}, strict=False)
    frozen = set(state.get("frozen_param_shapes", {})) if len(sd) < len(engine.module.state_dict()) else set()
    missing = [k for k in missing if k not in frozen]  # excluded frozen parameters keep their values
    if strict and (missing or unexpected):
        raise CheckpointError(f"the checkpoint's module does not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]} (load_module_strict=False to load what matches)")


def _check_layout(engine, manifest, state, tag_dir) -> None:
    numels = [g.numels for g in engine.optimizer.flat_groups]
    if manifest["groups"] != numels:
        raise CheckpointError(
            f"{os.path.join(tag_dir, MANIFEST)}: the checkpoint's param groups hold {manifest['groups']} elements "
            f"per parameter, this engine's {numels}: a different model or parameter grouping")


def _load_optimizer(engine, tag_dir: str, manifest: Dict[str, Any]) -> None:
    opt = engine.optimizer
    saved_world = manifest["layout_world"]
    here_world = opt.flat_groups[0].world if opt.flat_groups[0].partitioned else 1
    bf16 = manifest["bf16"]
    same = saved_world == here_world and (saved_world == 1 or manifest["world_size"] == engine.world_size)
    ranks = [engine.global_rank if saved_world > 1 else 0] if same else range(saved_world)
    shards = {r: verified_load(tag_dir, optim_file(r, bf16), manifest) for r in ranks}
    first = shards[min(shards)]["optimizer_state_dict"]
    base_sd = first["base_optimizer_state"]
    state_by_index: Dict[int, Dict[str, Any]] = {}
    for gi, g in enumerate(opt.flat_groups):
        master = _reshard([shards[r]["optimizer_state_dict"]["single_partition_of_fp32_groups"][gi] for r in ranks],
                          g, same)
        with torch.no_grad():
            g.master.copy_(master)
            if g.master.data_ptr() != g.flat[g.lo:g.hi].data_ptr():
                g.flat[g.lo:g.hi].copy_(g.master)
        index = _state_index(engine, gi)
        per_rank = [shards[r]["optimizer_state_dict"]["base_optimizer_state"]["state"].get(index, {}) for r in ranks]
        entry = {}
        for key, value in per_rank[0].items():
            if torch.is_tensor(value) and value.dim() > 0:
                entry[key] = _reshard([s[key] for s in per_rank], g, same).to(value.dtype)
            else:
                entry[key] = value
        if entry:
            state_by_index[index] = entry
    opt.optimizer.load_state_dict({"state": state_by_index, "param_groups": base_sd["param_groups"]})
    opt.loss_scaler.load_state_dict(first["loss_scaler"])
    if same:
        _set_rng_state(shards[ranks[0]]["rng"])


def _state_index(engine, flat_index: int) -> int:
    """The base optimizer's state index of the flat group's master (groups without one have none)."""
    index, seen = 0, 0
    for g in engine.optimizer.groups:
        if g is None:
            continue
        if seen == flat_index:
            return index
        index += 1
        seen += 1
    raise IndexError(flat_index)


def _reshard(parts: List[torch.Tensor], g, same: bool) -> torch.Tensor:
    """This rank's partition of a flat tensor saved as `parts` (every saved rank's, or just ours)."""
    if same:
        return parts[0]
    total = sum(g.numels)
    full = torch.cat([p.reshape(-1).float() if p.dtype != torch.float32 else p.reshape(-1) for p in parts])[:total]
    out = torch.zeros(g.part, dtype=torch.float32)
    lo, hi = g.lo, min(g.hi, total)
    if hi > lo:
        out[:hi - lo] = full[lo:hi]
    return out
