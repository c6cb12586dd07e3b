"""A checkpoint's layout: which fp32 partition holds which parameter, and moving values between layouts.

The layout, stored in the manifest, names each optimizer group's parameters and sizes in order, with the
stage and world size that cut them (with MiCS the shard size, and ``mics_shard_size``: the other
shard groups hold replicas of shard group 0's partitions, so only its files are written). That is all it takes to rebuild every parameter's full fp32 value
(and each element-wise optimizer state) from the saved partitions (zero_to_fp32.param_values) and to
cut them again for another world size or stage: any stage 0-3 checkpoint loads into any stage 0-3
engine, at any world size.
"""
from typing import Any, Dict, List

import torch

from .experts import expert_layout


def describe(engine) -> Dict[str, Any]:
    opt = engine.zero_optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    stage = engine.config.zero_optimization.stage
    groups = [{"params": [names[id(p)] for p in g.params], "numels": list(g.numels)} for g in opt.flat_groups]
    world = opt.world if stage >= 1 else 1  # the partition group's: MiCS's shard size (zero/mics.py)
    out = {"stage": stage, "world": world, "groups": groups}
    if stage == 3 and world < engine.world_size:  # MiCS: shard group 0 wrote the files, replicas hold the same
        out["mics_shard_size"] = world
    if getattr(engine, "has_moe_layers", False):  # (checkpoint/experts.py: loads where these match only)
        out["moe_layers"] = expert_layout(engine)
    return out


def scatter(engine, full: Dict[str, torch.Tensor], like: List[torch.Tensor]) -> List[torch.Tensor]:
    """This rank's partitions (shaped like ``like``, one per group) of full per-parameter values."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    for g, ref in zip(engine.zero_optimizer.flat_groups, like):
        part = torch.zeros(ref.shape, dtype=torch.float32, device=ref.device)
        for i, p in enumerate(g.params):
            piece = g.piece_of(i)
            if piece is not None:
                value = full[names[id(p)]].reshape(-1)
                part[piece.part_offset:piece.part_offset + piece.length] = \
                    value[piece.param_offset:piece.param_offset + piece.length]
        out.append(part)
    return out
