"""Features zero_ext accepts in a config but does not implement yet, and the one check for them.

``load_config`` accepts every DeepSpeed key so real-world files load; the engine
(``initialize``, ``zero.Init``) calls :func:`reject_unimplemented` so that a feature that is not
built is refused with its key named, never silently ignored.

:data:`UNIMPLEMENTED` is plain data, meant to be edited: when a feature lands, delete its entry
(or narrow its ``values``) in the same change. An entry is either

* ``"reason"`` — any value other than the key's default is refused, or
* ``{"reason": ..., "values": [...]}`` — only the listed values are refused.

docs/config.md is generated from this table too (regenerate it after editing).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple, Union

from .base import ConfigModel, field_default
from .errors import Problem, UnimplementedFeatureError, format_value
from .loader import load_config

Entry = Union[str, Dict[str, Any]]

UNIMPLEMENTED: Dict[str, Entry] = {
    # -- ZeRO stage 3 and its relatives --------------------------------------------------------
    "zero_optimization.offload_optimizer.super_offload": "SuperOffload",
    "zero_optimization.zeropp_loco_param": "LoCo-ZeRO++ error feedback (DeepSpeed 0.19.8 removed it too: "
                                           "deepspeedai/DeepSpeed#8489)",
    "zero_optimization.zenflow": "ZenFlow",
    "zero_optimization.allgather_sequential": "sequential parameter all-gather",
    "zero_optimization.round_robin_gradients": "round-robin gradient partitioning",
    "zero_optimization.load_from_fp32_weights": "master weights from 16-bit checkpoint weights",
    "zero_optimization.ignore_unused_parameters": "the unused-parameter check",
    "zero_optimization.grad_hooks": "reducing gradients only after backward",
    # -- precision ---------------------------------------------------------------------------
    "fp16.enabled": "fp16 mixed precision with loss scaling",
    "fp16.auto_cast": "fp16 input auto-cast",
    "fp16.fp16_master_weights_and_grads": "fp16 master weights",
    "data_types.grad_accum_dtype": "a separate gradient-accumulation dtype",
    "communication_data_type": "gradient communication in another dtype",
    # -- optimizer, scheduler, gradients ---------------------------------------------------------
    "optimizer.type": {"reason": "this DeepSpeed optimizer",
                       "values": ["lamb", "onebitadam", "zerooneadam", "onebitlamb",
                                  "muadam", "muadamw", "musgd"]},
    "optimizer.legacy_fusion": "the legacy fused fp16 optimizer",
    "prescale_gradients": "gradient pre-scaling",
    "gradient_predivide_factor": "gradient pre-division",
    "sparse_gradients": "sparse embedding gradients",
    "disable_allgather": "broadcast instead of all-gather",
    # -- I/O, checkpoints, engine ----------------------------------------------------------------
    "aio.use_gds": "GPUDirect Storage",
    "checkpoint.tag_validation": "checkpoint tag validation modes other than WARN",
    "checkpoint.load_universal": "universal checkpoints",
    "checkpoint.use_node_local_storage": "node-local checkpoint storage",
    "checkpoint.parallel_write.pipeline_stage": "pipeline-parallel checkpoint writing",
    "checkpoint.checkpoint_serialization": "legacy (non-zipfile) checkpoint serialization",
    "checkpoint.writer": "the fast checkpoint writer",
    "dataloader_drop_last": "the engine's data loader",
    "graph_harvesting": "CUDA-graph capture",
    "sequence_parallel_size": "sequence parallelism",
    "data_parallel_size": "device meshes",
    # -- other DeepSpeed subsystems ---------------------------------------------------------------
    "amp.enabled": "NVIDIA Apex AMP",
    "elasticity.enabled": "elastic training",
    "compile.deepcompile": "DeepCompile",
    "hybrid_engine.enabled": "the hybrid (RLHF) engine",
    "progressive_layer_drop.enabled": "progressive layer drop",
    "curriculum_learning.enabled": "curriculum learning",
    "data_efficiency.enabled": "the data efficiency library",
    "quantize_training.enabled": "MoQ quantize-aware training",
    "compression_training": "the compression library",
    "weight_quantization": "weight quantization",
    "tensor_parallel": "tensor parallelism (AutoTP)",
    "expert_parallel": "expert parallelism (AutoEP)",
}

#: Entries of UNIMPLEMENTED that ``initialize`` does implement: it passes them as ``implemented=``
#: (zero_ext/initialize.py's IMPLEMENTED must name the same keys; a test checks it). They stay in
#: the table because ``reject_unimplemented(cfg)`` without ``implemented=`` still refuses them;
#: docs/config.md lists them as implemented.
IMPLEMENTED_BY_INITIALIZE = (
    "zero_optimization.ignore_unused_parameters", "fp16.enabled", "communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "data_types.grad_accum_dtype",
    "checkpoint.tag_validation", "checkpoint.load_universal",
)

_ABSENT = object()


def entry_parts(entry: Entry) -> Tuple[str, Any]:
    """(reason, refused values or None for "anything but the default")."""
    if isinstance(entry, str):
        return entry, None
    return entry["reason"], list(entry["values"])


def lookup(cfg: ConfigModel, path: str) -> Tuple[Any, Any]:
    """(value, default) of a dotted key path; value is _ABSENT when a parent section is unset."""
    holder: Any = cfg
    parts = path.split(".")
    for part in parts[:-1]:
        holder = getattr(holder, part)
        if holder is None:
            return _ABSENT, None
    name = parts[-1]
    if name not in type(holder).model_fields:
        raise KeyError(f"{path!r} is not a config key (UNIMPLEMENTED is out of date?)")
    return getattr(holder, name), field_default(type(holder), name)


def unimplemented_problems(cfg: ConfigModel, implemented: Iterable[str] = ()) -> List[Problem]:
    """Problems for every feature in ``cfg`` that is in UNIMPLEMENTED and not ``implemented``."""
    skip = set(implemented)
    unknown = sorted(skip - set(UNIMPLEMENTED))
    if unknown:
        raise ValueError(f"implemented= names keys that are not in UNIMPLEMENTED: {unknown}")
    problems = []
    for path, entry in UNIMPLEMENTED.items():
        if path in skip:
            continue
        value, default = lookup(cfg, path)
        reason, refused = entry_parts(entry)
        if value is _ABSENT:
            continue
        if refused is None and value != default:
            fix = "remove the key" if default is None else \
                f"remove the key or use the default {format_value(default)}"
            problems.append(Problem(path, value,
                                    f"zero_ext does not implement {reason} yet; {fix}"))
        elif refused is not None and value in refused:
            problems.append(Problem(path, value, f"zero_ext does not implement {reason} yet"))
    return problems


def reject_unimplemented(cfg: Any, implemented: Iterable[str] = ()) -> None:
    """Raise :class:`UnimplementedFeatureError` (a ConfigError) naming every key of ``cfg`` that
    asks for a feature zero_ext does not implement yet.

    ``cfg``: a loaded DeepSpeedConfig (or anything :func:`load_config` accepts).
    ``implemented``: keys of UNIMPLEMENTED the caller does handle (e.g. a code path that
    supports one feature before the table entry is removed). Unknown keys here are a
    programming error (ValueError), so a typo cannot silently let a feature through.
    """
    if not isinstance(cfg, ConfigModel):
        cfg = load_config(cfg)
    problems = unimplemented_problems(cfg, implemented)
    if problems:
        raise UnimplementedFeatureError(problems)
