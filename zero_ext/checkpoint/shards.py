"""The optimizer files of a checkpoint, read into this engine (engine_state.load_checkpoint): with the
layout unchanged only this rank's file, its partitions as saved; otherwise every saved rank's, rebuilt
into full per-parameter values and cut again for this engine (layout.scatter). Tensors that outlive the
load are copied out of the files' mappings (``owned``)."""
from collections import OrderedDict
from typing import Any, Dict, List

import torch

from . import layout as layout_of
from .files import CheckpointError, verified_load
from .zero_to_fp32 import param_values


def optim_file(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def partition_key(stage: int) -> str:
    return "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"  # DeepSpeed's names


class Shards:
    """The saved optimizer files this load reads: this rank's alone when the layout is unchanged."""

    def __init__(self, same: bool, files: Dict[int, Dict[str, Any]]):
        self.same, self.files = same, files

    def osd(self, r: int) -> Dict[str, Any]:
        return self.files[r]["optimizer_state_dict"]

    @property
    def first(self) -> Dict[str, Any]:
        return self.osd(min(self.files))


def experts_apart(opt) -> bool:
    """Stage 0 with expert-parallel groups (optim/experts.py): each rank's file holds its own experts."""
    return opt.stage == 0 and any(getattr(g, "domain", None) is not None for g in opt.flat_groups)


def read_shards(engine, tag_dir: str, manifest: Dict[str, Any]) -> Shards:
    saved = manifest["layout"]
    same = saved == layout_of.describe(engine) and manifest["world_size"] == engine.world_size
    if not same and (saved.get("moe_layers") or getattr(engine, "has_moe_layers", False)):
        raise CheckpointError(f"{tag_dir}: a checkpoint of a mixture-of-experts model loads only into the same "
                              f"world size, ZeRO stage and expert-parallel sizes (saved: world size "
                              f"{manifest['world_size']}, stage {saved['stage']}, MoE layers "
                              f"{saved.get('moe_layers')}; here: world size {engine.world_size}, stage "
                              f"{engine.config.zero_optimization.stage}, MoE layers "
                              f"{layout_of.describe(engine).get('moe_layers')}): expert partitions are not "
                              "resharded; load it with the layout it was saved with")
    if same:
        # (MiCS: the rank in the shard group; stage 0 with experts apart: this rank's own file)
        ranks = [engine.zero_optimizer.rank if saved["world"] > 1 or experts_apart(engine.zero_optimizer) else 0]
    else:
        ranks = list(range(saved["world"]))
    return Shards(same, {r: verified_load(tag_dir, optim_file(r, manifest["bf16"]), manifest, mapped=True)
                          for r in ranks})


def load_masters(engine, saved: Dict[str, Any], shards: Shards) -> None:
    opt, key = engine.zero_optimizer, partition_key(saved["stage"])
    if shards.same:
        parts = shards.first[key]
    else:
        full = param_values(saved, [shards.osd(r)[key] for r in sorted(shards.files)])
        parts = layout_of.scatter(engine, full, [g.master for g in opt.flat_groups])
    with torch.no_grad():
        for g, part in zip(opt.flat_groups, parts):
            g.master.copy_(part)
            g.copy_master_to_params()


def load_optimizer_state(engine, saved: Dict[str, Any], shards: Shards) -> None:
    opt = engine.zero_optimizer
    saved_sd = shards.first["base_optimizer_state"]
    masters = [g.master for g in opt.flat_groups]
    if shards.same:
        state = saved_sd["state"]
    else:
        # each group's own state keys (Muon: momentum_buffer in its group, Adam's moments in the other)
        saved_state = [saved_sd["state"].get(i, {}) for i in range(len(saved["groups"]))]
        tensor_keys = [{k for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0} for s in saved_state]
        part_key = partition_key(saved["stage"])
        rebuilt = {}
        for k in sorted(set().union(*tensor_keys)):
            per_rank = [[osd["base_optimizer_state"]["state"][i][k] if k in tensor_keys[i] else
                         torch.zeros_like(osd[part_key][i]) for i in range(len(saved["groups"]))]
                        for osd in (shards.osd(r) for r in sorted(shards.files))]
            rebuilt[k] = layout_of.scatter(engine, param_values(saved, per_rank), masters)
        state = {i: {**{k: v for k, v in saved_state[i].items() if k not in tensor_keys[i]},
                     **{k: rebuilt[k][i] for k in tensor_keys[i]}} for i in range(len(masters))}
    # this engine's param groups, with the saved hyper-parameters (lr, betas, ...) of each group
    index, groups = 0, []
    for here, there in zip(opt.optimizer.param_groups, saved_sd["param_groups"]):
        count = len(here["params"])
        groups.append({**{k: v for k, v in there.items() if k != "params"}, "params": list(range(index, index + count))})
        index += count
    opt.optimizer.load_state_dict({"state": into_current(opt.optimizer, state), "param_groups": groups})
    opt.loss_scaler.load_state_dict(shards.first["loss_scaler"])


def owned(value):
    """``value`` with every tensor in it copied out of the file's mapping (verified_load's ``mapped``), for
    what outlives the load: a tensor left viewing the mapping would keep the file mapped (its disk space
    held after the checkpoint is deleted)."""
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return type(value)((k, owned(v)) for k, v in value.items()) if type(value) in (dict, OrderedDict) else value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(owned(v) for v in value)
    return value


def into_current(optimizer, state: Dict[int, Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """The loaded optimizer state (by index), each tensor copied into the tensor the optimizer holds now
    for it where it has one of the same shape and dtype (no new memory to fault in: the load writes where
    the state lives), else into a new one (owned)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = {}
    for i, entry in state.items():
        current = optimizer.state.get(params[i], {}) if i < len(params) else {}
        out[i] = {}
        for k, v in entry.items():
            here = current.get(k)
            if (torch.is_tensor(v) and torch.is_tensor(here) and here.shape == v.shape and here.dtype == v.dtype
                    and here.device.type == "cpu" and v.dim() > 0):
                with torch.no_grad():
                    here.copy_(v)
                out[i][k] = here
            else:
                out[i][k] = owned(v)
    return out


def frozen_pieces(shards: Shards) -> List[Dict[str, torch.Tensor]]:
    return [shards.osd(r).get("frozen_pieces", {}) for r in sorted(shards.files)]
