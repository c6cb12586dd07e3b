"""Rebuild a full fp32 state dict from a zero_ext ZeRO checkpoint, offline, on one CPU process.

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--max_shard_size 5GB] [--safe_serialization]
    python -m zero_ext.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR

Standalone on purpose: it needs only torch (and safetensors for --safe_serialization), and a copy of
this file is written next to every checkpoint, so a checkpoint can be converted where zero_ext is not
installed. Shards are read one at a time, memory-mapped, so peak memory stays near the output's size.
Every trainable parameter comes from the fp32 master partitions; frozen parameters and buffers from
the module's own saved state; tied parameters share one tensor under each name.
"""
import argparse
import json
import os
import re
import sys
from collections import OrderedDict

import torch

MODEL_FILE = "mp_rank_00_model_states.pt"


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _resolve_tag(checkpoint_dir, tag):
    publisher = sys.modules.get("zero_ext.checkpoint.publish")  # (standalone: never loaded)
    if publisher is not None:
        publisher.wait()  # a save of this process still being published ends first
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.exists(latest):
            raise ValueError(f"Unable to find 'latest' file at {latest}; pass the tag (-t)")
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    return folder


def _shard(numel, world):
    return -(-numel // world)


def param_values(layout, partitions):
    """name -> 1-D tensor of each trainable parameter, rebuilt from every rank's partitions.

    ``layout`` is the manifest's (zero_ext/checkpoint/layout.py): stage, world (1 for stage 0) and, per
    optimizer group, the parameter names and sizes in order. ``partitions[r][g]`` is rank r's 1-D
    partition of group g. Stages 0-2 lay a group's parameters end to end and cut the (padded) result
    into equal partitions; stage 3 cuts each parameter into pieces of ceil(numel / world).
    """
    world, out = layout["world"], OrderedDict()
    for gi, group in enumerate(layout["groups"]):
        parts = [partitions[r][gi] for r in range(world)]
        offset = 0
        if layout["stage"] == 3:
            for name, n in zip(group["params"], group["numels"]):
                s = _shard(n, world)
                out[name] = torch.cat([p[offset:offset + s] for p in parts])[:n]
                offset += s
        else:
            flat = torch.cat(parts)
            for name, n in zip(group["params"], group["numels"]):
                out[name] = flat[offset:offset + n]
                offset += n
    return out


def piece_values(numels, pieces_by_rank):
    """name -> 1-D tensor of ZeRO-3 parameters saved as per-rank pieces (frozen parameters)."""
    world = len(pieces_by_rank)
    return OrderedDict((name, torch.cat([pieces_by_rank[r][name] for r in range(world)])[:n])
                       for name, n in numels.items())


def _optim_files(folder):
    pattern = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
    found = sorted((int(m.group(2)), name) for name in os.listdir(folder) if (m := pattern.match(name)))
    return [name for _, name in found]


def get_optim_files(checkpoint_dir):
    """The optimizer shard files of one checkpoint folder (a tag's folder), full paths in rank order;
    none is a FileNotFoundError. DeepSpeed's helper of the same name (Lightning reads the stage from the first)."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint folder '{checkpoint_dir}' does not exist")
    # As DeepSpeed's: every *_optim_states.pt, in natural order (rank 10 after rank 9), whatever the prefix
    files = sorted((f for f in os.listdir(checkpoint_dir) if f.endswith("_optim_states.pt")), key=_natural)
    if not files:
        raise FileNotFoundError(f"no *_optim_states.pt files in '{checkpoint_dir}'")
    return [os.path.join(checkpoint_dir, f) for f in files]


def _natural(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def get_model_state_file(checkpoint_dir, zero_stage):
    """The model-states file of one checkpoint folder. zero_ext writes mp_rank_00_model_states.pt at every
    stage; DeepSpeed's stage-3 name (zero_pp_rank_0_mp_rank_00_model_states.pt) is taken when only it exists."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint folder '{checkpoint_dir}' does not exist")
    names = [MODEL_FILE] + (["zero_pp_rank_0_mp_rank_00_model_states.pt"] if int(zero_stage) == 3 else [])
    for name in names:
        path = os.path.join(checkpoint_dir, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"no model states file ({' or '.join(names)}) in '{checkpoint_dir}'")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """OrderedDict name -> fp32 tensor of the whole model at the checkpoint."""
    folder = _resolve_tag(checkpoint_dir, tag)
    model = _load(os.path.join(folder, MODEL_FILE))
    with open(os.path.join(folder, "zero_ext_manifest.json")) as f:
        layout = json.load(f)["layout"]
    parallel = [layer for layer in layout.get("moe_layers", []) if layer["ep_size"] > 1]
    if parallel:  # the ranks' files hold different experts under the same names
        raise ValueError(f"{folder}: a checkpoint of a mixture-of-experts model with expert parallelism (ep_size "
                         f"{parallel[0]['ep_size']}) cannot be consolidated offline yet; load it into an engine "
                         "of the same world size and read the weights with deepspeed.utils.safe_get_full_fp32_param "
                         "on each rank (the experts' 16-bit weights are in its layer_*_expert_*_model_states.pt files)")
    files = _optim_files(folder)
    if len(files) != layout["world"]:
        raise ValueError(f"{folder} holds {len(files)} optimizer state files but they were saved by "
                         f"{layout['world']} ranks: possibly an overwrite of an older checkpoint")
    osds = [_load(os.path.join(folder, name))["optimizer_state_dict"] for name in files]  # memory-mapped
    key = "fp32_flat_groups" if layout["stage"] == 3 else "single_partition_of_fp32_groups"
    out = OrderedDict()
    for name, value in param_values(layout, [o[key] for o in osds]).items():
        out[name] = value.view(*model["param_shapes_by_name"][name]).float().clone()
    module = model["module"]
    if not exclude_frozen_parameters:
        frozen = model.get("frozen_param_shapes", {})
        if layout["stage"] == 3 and frozen:
            numels = OrderedDict((n, _numel(shape)) for n, shape in frozen.items())
            for name, value in piece_values(numels, [o.get("frozen_pieces", {}) for o in osds]).items():
                out[name] = value.view(*frozen[name]).float().clone()
        else:
            for pname in frozen:
                if pname in module:
                    out[pname] = module[pname].float().clone()
    for bname in model.get("buffer_names", []):
        if bname in module:
            t = module[bname]
            out[bname] = t.float().clone() if t.is_floating_point() else t.clone()
    for alias, pname in model.get("shared_params", {}).items():
        if pname in out:
            out[alias] = out[pname]
    return out


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _parse_size(size):
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size {size!r}: write e.g. 5GB or 500MB")
    return int(float(m.group(1)) * {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}[m.group(2)])


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Writes pytorch_model.bin (or model.safetensors), sharded with an index file past max_shard_size."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    limit = _parse_size(max_shard_size)
    shards, current, size = [], OrderedDict(), 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = OrderedDict(), 0
        current[name] = t
        size += nbytes
    shards.append(current)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = [f"{stem}.{ext}"] if len(shards) == 1 else [
        f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    for shard, fname in zip(shards, names):
        path = os.path.join(output_dir, fname)
        if safe_serialization:
            from safetensors.torch import save_file  # optional dependency

            save_file({k: v.contiguous().clone() for k, v in shard.items()}, path, metadata={"format": "pt"})
        else:
            torch.save(shard, path)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
                 "weight_map": {k: fname for shard, fname in zip(shards, names) for k in shard}}
        with open(os.path.join(output_dir, f"{stem}.{ext}.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Loads the fp32 weights into `model` (moved to CPU) and returns it."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(sd, strict=False)
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description="Rebuild a full fp32 state dict from a zero_ext checkpoint")
    p.add_argument("checkpoint_dir")
    p.add_argument("output_dir")
    p.add_argument("-t", "--tag", default=None)
    p.add_argument("--max_shard_size", default="5GB")
    p.add_argument("--safe_serialization", action="store_true")
    p.add_argument("--exclude_frozen_parameters", action="store_true")
    a = p.parse_args(argv)
    names = convert_zero_checkpoint_to_fp32_state_dict(a.checkpoint_dir, a.output_dir, a.max_shard_size,
                                                       a.safe_serialization, a.tag, a.exclude_frozen_parameters)
    print(f"wrote {', '.join(names)} to {a.output_dir}")


if __name__ == "__main__":
    main()
