"""Property: one mutation of a real-world config either loads as a valid config or is a ConfigError
naming the mutated key; never another exception, never a config holding an invalid value.

The configs are written here in our own words, after the shapes HF Trainer's DeepSpeed docs and
DeepSpeed-Chat's training scripts use (with HF's "auto" values resolved to numbers, or kept)."""

import copy
import math
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zero_ext.config import ConfigError, DeepSpeedConfig, load_config
from zero_ext.config.base import field_extra, submodel_of

HF_ZERO2_OFFLOAD = {
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-5,
                                                 "warmup_num_steps": 500}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "wall_clock_breakdown": False,
}

HF_ZERO3_OFFLOAD = {
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10000,
                                                      "warmup_min_lr": 0,
                                                      "warmup_max_lr": 5e-5,
                                                      "warmup_num_steps": 100}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": 1048576, "stage3_prefetch_bucket_size": 943718,
        "stage3_param_persistence_threshold": 10240, "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": 1,
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 8,
}

SEED_ZERO2_CPU_FP16 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                          "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7},
    "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 100},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": False,
                                             "adam_w_mode": True}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000,
                                                       "warmup_num_steps": 50,
                                                       "cos_min_ratio": 0.01}},
}

CHAT_ZERO3 = {  # DeepSpeed-Chat's get_train_ds_config with offload, resolved for 8 ranks
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 10,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                          "offload_optimizer": {"device": "cpu"},
                          "stage3_param_persistence_threshold": 1e4,
                          "stage3_max_live_parameters": 3e7,
                          "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False},
    "fp16": {"enabled": True, "loss_scale_window": 100},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "wall_clock_breakdown": False,
    "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                      "release_inference_cache": False, "pin_parameters": True,
                      "tp_gather_partition_size": 8},
    "tensorboard": {"enabled": False, "output_path": "step_tensorboard/ds_tensorboard_logs/",
                    "job_name": "step1_model_tensorboard"},
}

ONE_CYCLE_NVME = {
    "train_batch_size": 8,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                            "nvme_path": "/local_nvme",
                                                            "buffer_count": 4,
                                                            "pipeline_read": True}},
    "optimizer": {"type": "Adagrad", "params": {"lr": 1e-2, "eps": 1e-10}},
    "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2,
                                                 "cycle_first_step_size": 100,
                                                 "cycle_momentum": False}},
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1},
}

CONFIGS = [HF_ZERO2_OFFLOAD, HF_ZERO3_OFFLOAD, SEED_ZERO2_CPU_FP16, CHAT_ZERO3, ONE_CYCLE_NVME]
# Sections zero_ext ignores (their keys are not checked): mutations there prove nothing.
IGNORED = ("tensorboard", "hybrid_engine")
VALUES = [float("nan"), float("inf"), -1, 0, 1e30, [1], "x", None, True]


def _paths(node, prefix=()):
    for key, value in node.items():
        if prefix == () and key in IGNORED:
            continue
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from _paths(value, prefix + (key,))


CASES = [(i, path) for i, cfg in enumerate(CONFIGS) for path in _paths(cfg)]


def _one_edit(draw, key):
    kind = draw(st.sampled_from(["drop", "insert", "replace", "swap"]))
    i = draw(st.integers(0, len(key) - 1))
    letter = draw(st.sampled_from("aes_0"))
    if kind == "drop":
        return key[:i] + key[i + 1:]
    if kind == "insert":
        return key[:i] + letter + key[i:]
    if kind == "replace":
        return key[:i] + letter + key[i + 1:]
    return key[:i] + key[i + 1:i + 2] + key[i:i + 1] + key[i + 2:] if i + 1 < len(key) else key + "x"


@st.composite
def mutations(draw):
    index, path = draw(st.sampled_from(CASES))
    cfg = copy.deepcopy(CONFIGS[index])
    holder = cfg
    for part in path[:-1]:
        holder = holder[part]
    key = path[-1]
    kind = draw(st.sampled_from(["value", "value", "rename", "drop"]))
    if kind == "value":
        holder[key] = draw(st.sampled_from(VALUES))
        named = key
    elif kind == "rename":
        named = _one_edit(draw, key)
        if named in holder or not named:
            named = key + "_"
        holder[named] = holder.pop(key)
    else:
        del holder[key]
        named = key
    return cfg, kind, path, named


def _all_finite(node):
    if isinstance(node, float):
        return math.isfinite(node)
    if isinstance(node, int) and not isinstance(node, bool):
        return -2 ** 63 <= node < 2 ** 63
    if isinstance(node, dict):
        return all(_all_finite(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return all(_all_finite(v) for v in node)
    return True


def _without_deprecated(dumped, model=DeepSpeedConfig):
    """The dump minus deprecated keys (already migrated to their replacements)."""
    out = {}
    for key, value in dumped.items():
        if key not in model.model_fields or field_extra(model, key).get("deprecated"):
            continue
        sub = submodel_of(model.model_fields[key].annotation)
        out[key] = _without_deprecated(value, sub) if sub and isinstance(value, dict) else value
    return out


def _load(source):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(source)
        cfg.resolve_batch(2)
    return cfg


def test_the_unmutated_configs_load():
    for cfg in CONFIGS:
        _load(cfg)


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_one_mutation_is_valid_or_an_error_naming_the_key(case):
    source, kind, path, named = case
    try:
        cfg = _load(source)
    except ConfigError as err:
        assert named in str(err), (kind, path, named, str(err))
        return
    dumped = _without_deprecated(cfg.model_dump(mode="json"))
    assert _all_finite(dumped), (kind, path, named, dumped)
    assert _all_finite(cfg.model_dump()), (kind, path, named)
    # What loaded is a config: loading its own values again gives the same.
    again = _load(dumped)
    assert _without_deprecated(again.model_dump(mode="json")) == dumped, (kind, path, named)
