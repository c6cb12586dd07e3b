"""save_checkpoint / load_checkpoint for ZeRO stages 0-3 (DeepSpeed's folder layout and key names).

    <save_dir>/latest                                      the tag, written last (rank 0)
    <save_dir>/zero_to_fp32.py                             standalone converter (needs only torch)
    <save_dir>/<tag>/mp_rank_00_model_states.pt            module, counters, scheduler, client state (rank 0)
    <save_dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r's fp32 partitions,
                                                           optimizer state, loss scaler, RNG states
    <save_dir>/<tag>/zero_ext_manifest.json                sha256 and size of every file, the layout

Loading reshards: the manifest records which partition holds which parameter (layout.py), so
a checkpoint saved by W ranks at any stage 0-3 is rebuilt into full per-parameter values (fp32 masters
and element-wise optimizer state) and cut again for the N ranks and the stage loading it; an unchanged
layout reads only this rank's file. ZeRO-3 parameters are never gathered for a save: each rank writes
its pieces (frozen ones too). See docs/checkpoints.md.
"""
import json
import logging
import os
import importlib.metadata
import random
import shutil
import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import comm
from . import layout as layout_of
from ..comm import collective_check
from ..comm import native
from . import publish
from .files import (FORMAT_VERSION, MANIFEST, CheckpointError, atomic_write_bytes, check_tag, find_tag_dir, fsync_dir,
                    fsync_file, plain_data, publish_dir, read_manifest, reap_temporary_files, replaced_dir, staging_dir,
                    verified_load, write_torch_file)
from .serial_load import in_local_turns
from .experts import expert_states, is_expert_key, load_expert_states
from .shards import (experts_apart, frozen_pieces, load_masters, load_optimizer_state, optim_file, owned, partition_key,
                     read_shards)
from .zero_to_fp32 import piece_values

logger = logging.getLogger("zero_ext.checkpoint")

MODEL_FILE = "mp_rank_00_model_states.pt"
STANDARD_KEYS = {"module", "buffer_names", "param_shapes", "frozen_param_shapes", "shared_params", "lr_scheduler",
                 "global_steps", "global_samples", "skipped_steps", "micro_steps", "dp_world_size", "mp_world_size",
                 "ds_config", "ds_version", "zero_stage", "optimizer", "checkpoint_parallel_dimensions"}



# -- every rank must call ---------------------------------------------------------------------------------

def check_all_ranks_call(what: str, seq: int, timeout: float = None) -> None:
    """Fails (instead of hanging in the collectives that follow) when some rank does not call `what`."""
    collective_check.check_all_ranks_call(what, seq, timeout, error=CheckpointError,
                                          hint="; every rank writes its own shard")


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

def _zero_params(module) -> Dict[str, Any]:
    """name -> ZeroParam of the module's partitioned (stage 3) parameters."""
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):  # tied names too
        owner = getattr(p, "_zero_owner", None)
        if owner is not None:
            out[name] = owner
    return out


def _shape(p) -> List[int]:
    return list(getattr(p, "ds_shape", p.shape))


def _refuse_model_parallel(engine, what: str) -> None:
    """Checkpoints are laid out per data-parallel rank of one model: with an mpu splitting the model over
    model-parallel ranks each part would need files of its own, which zero_ext does not write yet."""
    if engine.world_size != comm.get_world_size():
        raise NotImplementedError(
            f"{what}: the engine's mpu splits the {comm.get_world_size()} ranks into data-parallel groups of "
            f"{engine.world_size} (model parallelism); zero_ext's checkpoints hold one model's data-parallel "
            "partitions and are not implemented for model-parallel parts yet; save through your model-parallel "
            "framework, or gather the model first")


def save_checkpoint(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """Writes every rank's files into the tag's staging folder; rank 0 then makes them durable and
    publishes the tag, before every rank returns (or after, in the background mode: [Note: background
    publish] in publish.py)."""
    if not save_dir:
        raise ValueError("save_checkpoint: save_dir is empty; give the folder to save into")
    _refuse_model_parallel(engine, "save_checkpoint")
    check_all_ranks_call("save_checkpoint", engine.next_collective_seq())
    rank, world = engine.global_rank, engine.world_size
    tag = check_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}", "save_checkpoint's tag")
    final_dir = os.path.join(save_dir, tag)
    tag_dir = staging_dir(save_dir, tag)  # every rank writes here; rank 0 then puts it in place whole
    problem = publish.settle()  # the previous save's publish (rank 0's)
    if rank == 0 and problem is None:
        problem = _prepare_staging(save_dir, tag_dir)
    hosts = _agree_to_start(engine, tag, problem)
    cfg = engine.config
    stage = cfg.zero_optimization.stage
    bf16 = cfg.bf16.enabled
    digests, problem = {}, None
    try:
        # stage 0 replicates: rank 0's copy is the whole state; MiCS: shard group 0's (ranks 0 .. shard size - 1)
        # (stage 0 with expert-parallel groups: the ranks hold different experts, each writes its own)
        if (stage >= 1 and rank < engine.zero_optimizer.world) or rank == 0 or experts_apart(engine.zero_optimizer):
            name = optim_file(rank, bf16)
            digests[name] = write_torch_file(_optim_state(engine, exclude_frozen_parameters), os.path.join(tag_dir, name))
        if engine.has_moe_layers:  # one file per expert, by its expert-data-parallel group's first rank
            for name, experts in expert_states(engine.module, engine.module.state_dict()).items():
                digests[name] = write_torch_file(experts, os.path.join(tag_dir, name))
        if rank == 0:
            state = _model_state(engine, exclude_frozen_parameters)
            for key, value in (client_state or {}).items():
                if key in STANDARD_KEYS:
                    raise KeyError(f"save_checkpoint: client_state key {key!r} is reserved by the checkpoint format")
                state[key] = value
            digests[MODEL_FILE] = write_torch_file(state, os.path.join(tag_dir, MODEL_FILE))
        if hosts[rank] != hosts[0]:  # rank 0's fsync would not reach this machine's page cache
            for name in digests:
                fsync_file(os.path.join(tag_dir, name))
    except (OSError, KeyError) as exc:
        problem = f"rank {rank}: {type(exc).__name__}: {exc}"
    gathered = [None] * world if rank == 0 else None
    if world > 1:
        comm.gather_object((digests, problem), gathered, dst=0)
    else:
        gathered = [(digests, problem)]
    if rank == 0:
        problem = "; ".join(p for _, p in gathered if p) or None
        if problem is None:
            files = {k: v for d, _ in gathered for k, v in d.items()}
            manifest = {"format_version": FORMAT_VERSION, "tag": tag, "world_size": world, "zero_stage": stage,
                        "bf16": bf16, "layout": layout_of.describe(engine), "files": files}
            try:
                with open(os.path.join(tag_dir, MANIFEST), "wb") as f:
                    f.write(json.dumps(manifest, indent=1).encode())
                publish.start(f"save_checkpoint({save_dir!r}, tag={tag!r})",
                              lambda: _publish(save_dir, tag, tag_dir, final_dir, [*files, MANIFEST], save_latest))
                if not publish.in_background():  # in place before any rank returns
                    problem = publish.settle()
            except OSError as exc:
                problem = f"rank 0: {type(exc).__name__}: {exc}"
    verdict = [problem]
    if world > 1:  # rank 0's verdict (every rank's failures, the manifest) to all
        verdict = [None] * world
        comm.all_gather_object(verdict, problem if rank == 0 else None)
    if verdict[0] is not None:
        if rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
        raise CheckpointError(f"save_checkpoint({save_dir!r}, tag={tag!r}) failed, nothing was published: "
                              f"{verdict[0]}")
    return True


def _prepare_staging(save_dir: str, tag_dir: str) -> Optional[str]:
    """Rank 0: an empty staging folder (a killed save's leftovers removed). None, or what went wrong."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        reap_temporary_files(save_dir)
        shutil.rmtree(tag_dir, ignore_errors=True)  # a killed save's leftovers
        os.makedirs(tag_dir)
    except OSError as exc:
        return f"rank 0 cannot make the folder {tag_dir}: {exc}"
    return None


def _agree_to_start(engine, tag: str, problem: Optional[str]) -> List[str]:
    """One exchange before any file is written: every rank's tag (checkpoint.tag_validation), host, and
    what keeps it from saving (the previous save's publish failed, the folder cannot be made), which
    every rank then raises alike. Returns each rank's host."""
    host = native.host_id()
    if engine.world_size == 1:
        rows = [(tag, host, problem)]
    else:
        rows = [None] * engine.world_size
        comm.all_gather_object(rows, (tag, host, problem))
    failed = [p for _, _, p in rows if p]
    if failed:
        if any("was not published" in p for p in failed):
            raise publish.CheckpointPublishError("; ".join(failed))
        raise CheckpointError("; ".join(failed))
    mode = engine.config.checkpoint.tag_validation
    tags = [t for t, _, _ in rows]
    if mode != "IGNORE" and len(set(tags)) > 1:
        msg = f"checkpoint tags differ across ranks: {tags}; pass the same tag on every rank"
        if mode == "FAIL":
            raise TagMismatchError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
    return [h for _, h, _ in rows]


def _publish(save_dir: str, tag: str, tag_dir: str, final_dir: str, names: List[str], save_latest: bool) -> None:
    """Rank 0, in the background: durable, then in place (see publish.py)."""
    for name in names:
        fsync_file(os.path.join(tag_dir, name))
    fsync_dir(tag_dir)
    mode = os.stat(os.path.join(tag_dir, MANIFEST)).st_mode & 0o777  # the umask of the save, not of now
    publish_dir(tag_dir, final_dir, replaced_dir(save_dir, tag))
    with open(os.path.join(os.path.dirname(__file__), "zero_to_fp32.py"), "rb") as f:
        # a script, executable where the checkpoint is readable (as DeepSpeed's): 0644 -> 0755, 0600 -> 0700
        atomic_write_bytes(os.path.join(save_dir, "zero_to_fp32.py"), f.read(), sync_dir=not save_latest,
                           if_changed=True, mode=mode | (mode & 0o444) >> 2)
    if save_latest:
        atomic_write_bytes(os.path.join(save_dir, "latest"), tag.encode(), mode=mode)


def settle_publish(engine) -> None:
    """Collective: waits for this process's save in flight to be published; a failure is the same
    CheckpointPublishError on every rank (load_checkpoint and engine.wait_for_checkpoint call it)."""
    problem = publish.settle()
    problems = [problem]
    if engine.world_size > 1:
        problems = [None] * engine.world_size
        comm.all_gather_object(problems, problem)
    failed = [p for p in problems if p]
    if failed:
        raise publish.CheckpointPublishError("; ".join(failed))


class TagMismatchError(CheckpointError, AssertionError):
    """checkpoint.tag_validation "FAIL": the ranks passed different tags (DeepSpeed asserts)."""


def _model_state(engine, exclude_frozen: bool) -> Dict[str, Any]:
    module, opt = engine.module, engine.zero_optimizer
    names = _param_names(module)
    zero = _zero_params(module)
    sd = {k: v for k, v in module.state_dict().items() if k not in zero}  # stage 3 pieces go to the shards
    if engine.has_moe_layers:  # the experts are in their own files (checkpoint/experts.py)
        sd = {k: v for k, v in sd.items() if not is_expert_key(module, k)}
    if exclude_frozen:
        for n, p in module.named_parameters():
            if not p.requires_grad:
                sd.pop(n, None)
    return {
        "module": sd,
        "buffer_names": [n for n, _ in module.named_buffers()],
        "param_shapes": [OrderedDict((names[id(p)], _shape(p)) for p in g.params) for g in opt.flat_groups],
        "param_shapes_by_name": {n: _shape(p) for n, p in module.named_parameters()},
        "frozen_param_shapes": OrderedDict((n, _shape(p)) for n, p in module.named_parameters()
                                           if not p.requires_grad and not exclude_frozen),
        "shared_params": _shared_params(module),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
        "dp_world_size": engine.world_size, "mp_world_size": 1, "zero_stage": engine.config.zero_optimization.stage,
        "ds_config": plain_data(engine.config.raw), "ds_version": f"zero_ext-{_version()}", "optimizer": None,
    }




def _optim_state(engine, exclude_frozen: bool) -> Dict[str, Any]:
    opt = engine.zero_optimizer
    stage = engine.config.zero_optimization.stage
    scaler = opt.loss_scaler
    osd = {
        "zero_stage": stage, "loss_scaler": scaler.state_dict(), "dynamic_loss_scale": scaler.dynamic,
        "overflow": opt.overflow, "clip_grad": opt.clip, "base_optimizer_state": opt.optimizer.state_dict(),
        partition_key(stage): [_alone(g.master) for g in opt.flat_groups],
        "partition_count": opt.world if stage >= 1 else 1,
    }
    if stage == 3 and not exclude_frozen:
        osd["frozen_pieces"] = {n: zp.shard.detach().clone() for n, zp in _zero_params(engine.module).items()
                                if not zp.param.requires_grad}
    return {"optimizer_state_dict": osd, "rng": _rng_state(), "ds_version": f"zero_ext-{_version()}"}


def _alone(t: torch.Tensor) -> torch.Tensor:
    """``t`` as torch.save should see it: itself when it spans its whole storage (nothing is copied),
    else a copy (torch.save writes a view's whole storage)."""
    t = t.detach()
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def _version() -> str:
    return importlib.metadata.version("zero_ext")


# -- load -------------------------------------------------------------------------------------------------

def load_checkpoint(engine, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn=None) -> Tuple[Optional[str], Optional[dict]]:
    if custom_load_fn is not None:
        raise ValueError("load_checkpoint: custom_load_fn is not supported by zero_ext")
    _refuse_model_parallel(engine, "load_checkpoint")
    check_all_ranks_call("load_checkpoint", engine.next_collective_seq())
    settle_publish(engine)  # a save of this run still being published is loadable once it is
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.exists(latest):
            warnings.warn(f"load_checkpoint: no 'latest' file in {load_dir} and no tag given; nothing loaded",
                          RuntimeWarning, stacklevel=3)
            return None, None
        with open(latest) as f:
            tag = check_tag(f.read().strip(), f"read from {latest}")
    else:
        tag = check_tag(str(tag), "load_checkpoint's tag")
    tag_dir = find_tag_dir(load_dir, tag)
    with_optimizer = load_optimizer_states and not load_module_only

    def read():
        if not os.path.isdir(tag_dir):
            raise CheckpointError(f"checkpoint folder {tag_dir} does not exist")
        manifest = read_manifest(tag_dir)
        state = verified_load(tag_dir, MODEL_FILE, manifest, mapped=True)
        if engine.has_moe_layers:  # this rank's experts, from their own files
            state["module"] = {**state["module"], **load_expert_states(
                engine.module, lambda name: verified_load(tag_dir, name, manifest, mapped=True))}
        saved = manifest["layout"]
        _check_layout(engine, saved, tag_dir)
        # stage 3 saves its weights only as fp32 pieces: they are needed even for the module alone
        shards = read_shards(engine, tag_dir, manifest) if with_optimizer or saved["stage"] == 3 else None
        return state, saved, shards

    def apply(state, saved, shards):
        _load_module(engine, state, load_module_strict, saved, shards)
        if shards is not None:
            load_masters(engine, saved, shards)
            if with_optimizer:
                load_optimizer_state(engine, saved, shards)
                if shards.same:  # (resharded: the saved ranks' RNG streams do not map onto these)
                    _set_rng_state(shards.files[min(shards.files)]["rng"])

    if engine.config.zero_optimization.pipeline_loading_checkpoint:  # one rank of a host at a time
        def read_and_apply():
            state, saved, shards = read()
            apply(state, saved, shards)
            return state, saved, None  # (the shards are freed before the next rank's turn)

        done, error = in_local_turns(engine.world_size, read_and_apply)
        state, saved, shards = _on_every_rank(engine, lambda: _raise_or(done, error))
    else:
        state, saved, shards = _on_every_rank(engine, read)
        apply(state, saved, shards)
    opt = engine.zero_optimizer
    if not (with_optimizer or saved["stage"] == 3):
        for g in opt.flat_groups:  # rebuild the fp32 masters from the loaded weights, as DeepSpeed does
            with torch.no_grad():
                g.master.copy_(g.flat[g.lo:g.hi])
    _refresh_weights(engine)
    if not load_module_only:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(owned(state["lr_scheduler"]))
        engine.restore_counters(state)
    engine.zero_grad()  # no gradients carry over a load
    client_state = {k: owned(v) for k, v in state.items() if k not in STANDARD_KEYS and k != "param_shapes_by_name"}
    if engine.world_size > 1:
        comm.barrier()
    return tag_dir, client_state


def _raise_or(result, error):
    """A serial load's outcome: every failure becomes a CheckpointError, which _on_every_rank agrees on."""
    if isinstance(error, (CheckpointError, OSError)):
        raise error
    if error is not None:
        raise CheckpointError(f"{type(error).__name__}: {error}") from error
    return result


def _on_every_rank(engine, read):
    """Runs ``read`` on every rank and agrees on the verdict: a damaged or missing file found by one rank
    is the same CheckpointError, naming the rank and the file, on every rank (instead of the others
    failing later with a transport error, or hanging, in the collectives that follow)."""
    try:
        result, error = read(), None
    except (CheckpointError, OSError) as exc:
        result, error = None, exc
    verdicts = [error and str(error)]
    if engine.world_size > 1:
        verdicts = [None] * engine.world_size
        comm.all_gather_object(verdicts, error and str(error))
    failed = [(r, v) for r, v in enumerate(verdicts) if v]
    if failed:
        if error is not None and len(failed) == 1:
            raise CheckpointError(f"rank {engine.global_rank}: {error}") from error
        raise CheckpointError("; ".join(f"rank {r}: {v}" for r, v in failed))
    return result


def _check_layout(engine, saved: Dict[str, Any], tag_dir: str) -> None:
    here = layout_of.describe(engine)
    def sizes(layout):
        return {n: k for g in layout["groups"] for n, k in zip(g["params"], g["numels"])}
    if sizes(saved) != sizes(here):
        mine, theirs = sizes(here), sizes(saved)
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:4]
        raise CheckpointError(f"{os.path.join(tag_dir, MANIFEST)}: the checkpoint's model does not match this one "
                              f"(trainable parameters differ, e.g. {diff}): a different model or parameter set")


def _refresh_weights(engine) -> None:
    """After the masters changed: every rank's model copy follows (stages 1/2 all-gather the new
    partitions; stage 3 re-gathers its persistent parameters)."""
    opt = engine.zero_optimizer
    stage = engine.config.zero_optimization.stage
    if stage in (1, 2) and engine.world_size > 1:
        opt.all_gather_params()
    if engine.zero_model is not None:
        engine.zero_model.refresh_persistent()


def _write_param(engine, p, value: torch.Tensor) -> None:
    """Sets a parameter's full value: a plain parameter's data, or a ZeRO-3 parameter's piece."""
    zp = getattr(p, "_zero_owner", None)
    with torch.no_grad():
        if zp is None:
            p.data.copy_(value.view(p.shape))
            return
        flat = value.reshape(-1).to(zp.shard.dtype)
        start = zp.rank * zp.shard_numel
        valid = max(0, min(zp.shard_numel, zp.numel - start))
        zp.shard.zero_()
        zp.shard[:valid].copy_(flat[start:start + valid])
        if zp.status.name == "AVAILABLE":
            zp.full.copy_(flat.view(zp.shape))


def _load_module(engine, state: Dict[str, Any], strict: bool, saved: Dict[str, Any], shards) -> None:
    sd, module, device = state["module"], engine.module, engine.device
    params = dict(module.named_parameters(remove_duplicate=False))  # tied names too
    zero = _zero_params(module)
    plain = {k: v.to(device) for k, v in sd.items() if k not in zero}
    with torch.no_grad():
        missing, unexpected = module.load_state_dict(plain, strict=False)
        for k, v in sd.items():
            if k in zero:
                _write_param(engine, params[k], v.to(device))
        frozen = state.get("frozen_param_shapes", {})
        if saved["stage"] == 3 and frozen and shards is not None:
            if shards.same:  # the same pieces: this rank's own, as saved
                mine = shards.first.get("frozen_pieces", {})
                for n, piece in mine.items():
                    if n in zero:
                        zero[n].shard.copy_(piece)
            else:
                numels = {n: int(torch.Size(s).numel()) for n, s in frozen.items()}
                for n, value in piece_values(numels, frozen_pieces(shards)).items():
                    if n in params:
                        _write_param(engine, params[n], value.to(device).view(frozen[n]))
    # trainable weights come from the fp32 masters; frozen ones not in the checkpoint keep their values
    restored = {n for g in saved["groups"] for n in g["params"]} | set(frozen) | set(sd)
    restored |= {alias for alias, name in _shared_params(module).items() if name in restored}  # tied names
    frozen_here = {n for n, p in params.items() if not p.requires_grad}
    missing = [k for k in missing if k not in restored and k not in frozen_here]
    if strict and (missing or unexpected):
        raise CheckpointError(f"the checkpoint's module does not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]} (load_module_strict=False to load what matches)")
