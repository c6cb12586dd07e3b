"""zero_optimization, offload_param, offload_optimizer, leaf_module, zenflow: defaults, aliases,
deprecations, validators and their error messages.

Expected defaults are written here from DeepSpeed 0.19.6's deepspeed/runtime/zero/config.py and
offload_config.py (not read from zero_ext), so a changed default fails a test.
"""

import sys
import warnings

import pytest

from zero_ext.config import (ConfigDeprecationWarning, ConfigError, ConfigWarning, ZeroConfig,
                             load_config, reject_unimplemented)
from zero_ext.config.offload import OffloadOptimizerConfig, OffloadParamConfig

DS_ZERO_DEFAULTS = {
    "stage": 0, "contiguous_gradients": True, "reduce_scatter": True,
    "reduce_bucket_size": 500_000_000, "use_multi_rank_bucket_allreduce": True,
    "allgather_partitions": True, "allgather_bucket_size": 500_000_000,
    "overlap_comm": False,  # stage 0
    "load_from_fp32_weights": True, "elastic_checkpoint": False, "offload_param": None,
    "offload_optimizer": None, "zenflow": None, "sub_group_size": 1_000_000_000,
    "cpu_offload_param": None, "cpu_offload_use_pin_memory": None, "cpu_offload": None,
    "prefetch_bucket_size": 50_000_000, "param_persistence_threshold": 100_000,
    "model_persistence_threshold": sys.maxsize, "max_live_parameters": 1_000_000_000,
    "max_reuse_distance": 1_000_000_000, "gather_16bit_weights_on_model_save": False,
    "module_granularity_threshold": 0, "use_all_reduce_for_fetch_params": False,
    "allgather_sequential": False, "stage3_gather_fp16_weights_on_model_save": None,
    "ignore_unused_parameters": True, "legacy_stage1": False, "round_robin_gradients": False,
    "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False,
    "zeropp_loco_param": None, "mics_shard_size": -1, "mics_hierarchical_params_gather": False,
    "memory_efficient_linear": True, "pipeline_loading_checkpoint": False,
    "override_module_apply": True, "log_trace_cache_warnings": False,
    "enable_sanity_checks": False, "save_muon_momentum_buffer_in_memory": False,
    "grad_hooks": True,  # documented in DeepSpeed's config-json.md only (its code rejects it)
}
DS_OFFLOAD_PARAM_DEFAULTS = {"device": "none", "nvme_path": None, "buffer_count": 5,
                             "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000,
                             "pin_memory": True}
DS_OFFLOAD_OPTIMIZER_DEFAULTS = {"device": "none", "nvme_path": None, "buffer_count": 4,
                                 "pin_memory": True, "pipeline_read": False,
                                 "pipeline_write": False, "fast_init": False, "ratio": 1.0,
                                 "super_offload": False, "cpuadam_cores_perc": 0.8}
ALIASES = [("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
           ("stage3_param_persistence_threshold", "param_persistence_threshold"),
           ("stage3_model_persistence_threshold", "model_persistence_threshold"),
           ("stage3_max_live_parameters", "max_live_parameters"),
           ("stage3_max_reuse_distance", "max_reuse_distance"),
           ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"),
           ("stage3_module_granularity_threshold", "module_granularity_threshold"),
           ("stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params"),
           ("stage3_allgather_sequential", "allgather_sequential")]
SIZE_KEYS = ["reduce_bucket_size", "allgather_bucket_size", "sub_group_size",
             "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
             "max_live_parameters", "max_reuse_distance", "zero_hpz_partition_size",
             "module_granularity_threshold"]


def zero(**keys):
    return {"zero_optimization": keys}


def load_quiet(source, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(source, **kw)


def error_of(source):
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(source)
    return info.value


# -- defaults ------------------------------------------------------------------------------------


def test_every_zero_key_has_an_expected_default():
    schema = set(ZeroConfig.model_fields) - {"leaf_module"}
    assert schema == set(DS_ZERO_DEFAULTS)


@pytest.mark.parametrize("key", sorted(DS_ZERO_DEFAULTS))
def test_zero_default(key):
    assert getattr(load_config({}).zero_optimization, key) == DS_ZERO_DEFAULTS[key]


@pytest.mark.parametrize("model, expected", [(OffloadParamConfig, DS_OFFLOAD_PARAM_DEFAULTS),
                                             (OffloadOptimizerConfig,
                                              DS_OFFLOAD_OPTIMIZER_DEFAULTS)])
def test_offload_defaults(model, expected):
    cfg = load_config(zero(stage=3, offload_param={}, offload_optimizer={}))
    section = (cfg.zero_optimization.offload_param if model is OffloadParamConfig
               else cfg.zero_optimization.offload_optimizer)
    assert set(model.model_fields) == set(expected)
    assert {k: getattr(section, k) for k in expected} == expected


def test_default_leaf_modules_are_the_moe_blocks():
    classes = load_config({}).zero_optimization.leaf_module.classes
    assert [c.rsplit(".", 1)[1] for c in classes] == [
        "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("given", [None, True, False])
def test_overlap_comm_defaults_to_true_only_for_stage3(stage, given):
    keys = {"stage": stage} if given is None else {"stage": stage, "overlap_comm": given}
    expected = (stage == 3) if given is None else given
    assert load_quiet(zero(**keys)).zero_optimization.overlap_comm is expected


def test_offload_device_compares_with_plain_strings():
    device = load_config(zero(stage=3, offload_param={"device": "cpu"})).zero_optimization\
        .offload_param.device
    assert device == "cpu" and device != "nvme" and str(device) == "cpu"


# -- aliases and numbers -------------------------------------------------------------------------


@pytest.mark.parametrize("alias, name", ALIASES)
@pytest.mark.parametrize("spelling", ["alias", "name"])
def test_alias_and_name_set_the_same_field(alias, name, spelling):
    value = True if ZeroConfig.model_fields[name].annotation is bool else 12345
    key = alias if spelling == "alias" else name
    assert getattr(load_quiet(zero(stage=3, **{key: value})).zero_optimization, name) == value


def test_alias_and_name_together_is_an_error():
    err = error_of(zero(stage=3, prefetch_bucket_size=1, stage3_prefetch_bucket_size=2))
    assert "given twice" in str(err) and "prefetch_bucket_size" in str(err)
    assert "stage3_prefetch_bucket_size" in str(err)


@pytest.mark.parametrize("key", SIZE_KEYS)
def test_sizes_accept_scientific_notation(key):
    assert getattr(load_quiet(zero(stage=3, **{key: 4e8})).zero_optimization, key) == 400_000_000


@pytest.mark.parametrize("key", SIZE_KEYS)
@pytest.mark.parametrize("bad, words", [(-1, "must be >= 0"), (2.5, "must be an integer"),
                                        (True, "not a boolean"), ("big", "must be an integer")])
def test_bad_sizes_name_key_value_and_rule(key, bad, words):
    err = error_of(zero(stage=3, **{key: bad}))
    assert err.paths == [f"zero_optimization.{key}"]
    assert words in str(err) and repr(bad)[:4].lower() in str(err).lower()


def test_error_names_the_alias_as_written():
    err = error_of(zero(stage=3, stage3_prefetch_bucket_size=-5))
    assert err.paths == ["zero_optimization.stage3_prefetch_bucket_size"]


@pytest.mark.parametrize("stage", [4, -1, 3.5, "three"])
def test_stage_out_of_range(stage):
    err = error_of(zero(stage=stage))
    assert err.paths == ["zero_optimization.stage"] and "got" in str(err)


@pytest.mark.parametrize("section, value, words", [
    ("offload_param", {"device": "disk"}, "'none', 'cpu' or 'nvme'"),
    ("offload_optimizer", {"device": "CPU"}, "'none', 'cpu' or 'nvme'"),
    ("offload_optimizer", {"device": "cpu", "ratio": 1.5}, "<= 1.0"),
    ("offload_optimizer", {"device": "cpu", "ratio": -0.1}, ">= 0.0"),
    ("offload_optimizer", {"device": "cpu", "cpuadam_cores_perc": 2}, "<= 1.0"),
    ("offload_param", {"device": "cpu", "buffer_count": -1}, ">= 0"),
    ("offload_param", {"device": "cpu", "pin_memory": "maybe"}, "true or false"),
])
def test_offload_value_errors(section, value, words):
    err = error_of(zero(stage=3, **{section: value}))
    assert len(err.problems) == 1 and err.paths[0].startswith(f"zero_optimization.{section}.")
    assert words in str(err)


# -- validators ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_param_below_stage3_warns_and_is_ignored(stage, device):
    # DeepSpeed reads offload_param only at stage 3; configs written for stage 3 keep it at lower stages
    from zero_ext.offload.plan import OffloadPlan

    with pytest.warns(ConfigWarning, match=f"offload_param has no effect at ZeRO stage {stage}"):
        cfg = load_config(zero(stage=stage, offload_param={"device": device, "nvme_path": "/x"}))
    assert cfg.zero_optimization.offload_param.device == device
    plan = OffloadPlan(cfg.zero_optimization)
    assert plan.param_device == "none" and not plan.params


def test_offload_param_device_none_is_fine_at_stage2():
    assert load_config(zero(stage=2, offload_param={"device": "none"})).zero_optimization.stage == 2


@pytest.mark.parametrize("stage, device, ok", [(3, "cpu", True), (3, "nvme", True),
                                               (2, "cpu", False), (1, "cpu", False),
                                               (3, "none", False)])
def test_partial_offload_needs_stage3_and_a_device(stage, device, ok):
    source = zero(stage=stage, offload_optimizer={"device": device, "nvme_path": "/x",
                                                  "ratio": 0.3})
    if ok:
        assert load_config(source).zero_optimization.offload_optimizer.ratio == 0.3
    else:
        err = error_of(source)
        assert err.paths == ["zero_optimization.offload_optimizer.ratio"]
        assert "partial offload" in str(err)


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_nvme_needs_nvme_path(section):
    err = error_of(zero(stage=3, **{section: {"device": "nvme"}}))
    assert err.paths == [f"zero_optimization.{section}.nvme_path"]
    assert "required" in str(err) and '"nvme"' in str(err)
    ok = load_config(zero(stage=3, **{section: {"device": "nvme", "nvme_path": "/nvme"}}))
    assert getattr(ok.zero_optimization, section).nvme_path == "/nvme"


@pytest.mark.parametrize("stage, device, words", [(0, "cpu", "stage 1, 2 or 3"), (0, "nvme", "stage 1, 2 or 3")])
def test_optimizer_offload_stage_rules(stage, device, words):
    err = error_of(zero(stage=stage, offload_optimizer={"device": device, "nvme_path": "/x"}))
    assert "zero_optimization.offload_optimizer.device" in err.paths and words in str(err)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_optimizer_offload_is_allowed_at_stages_1_to_3(stage):
    # (DeepSpeed allows it at stage 3 only; zero_ext's NVMe store serves stages 1-3 alike)
    cfg = load_config(zero(stage=stage, offload_optimizer={"device": "nvme", "nvme_path": "/x"}))
    assert str(cfg.zero_optimization.offload_optimizer.device) == "nvme"


@pytest.mark.parametrize("keys, path, words", [
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}},
     "offload_optimizer.super_offload", "stage 3"),
    ({"stage": 2, "pipeline_loading_checkpoint": True}, "pipeline_loading_checkpoint",
     "stage 3"),
    ({"stage": 1, "legacy_stage1": True}, "legacy_stage1", "removed"),
    ({"stage": 2, "allgather_bucket_size": 5}, "allgather_bucket_size", "multiple of 2"),
])
def test_stage_rules(keys, path, words):
    err = error_of(zero(**keys))
    assert err.paths == [f"zero_optimization.{path}"] and words in str(err)


@pytest.mark.parametrize("keys", [{"stage": 3, "allgather_bucket_size": 5},
                                  {"stage": 3, "pipeline_loading_checkpoint": True}])
def test_stage_rules_allow_the_other_stages(keys):
    assert load_quiet(zero(**keys)).zero_optimization.stage == keys["stage"]


# -- deprecated keys -----------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_elastic_checkpoint_is_accepted_with_a_deprecation_warning(stage):
    with pytest.warns(ConfigDeprecationWarning, match="elastic_checkpoint is deprecated and has no effect"):
        cfg = load_config(zero(stage=stage, elastic_checkpoint=True))
    reject_unimplemented(cfg)  # (nothing to refuse: checkpoints reshard natively)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(zero(stage=stage, elastic_checkpoint=False))  # false asks for nothing: silent


@pytest.mark.parametrize("old, new, stage", [("cpu_offload", "offload_optimizer", 2),
                                             ("cpu_offload_param", "offload_param", 3)])
def test_deprecated_offload_switch_migrates_with_warning(old, new, stage):
    with pytest.warns(ConfigDeprecationWarning, match=f"zero_optimization.{old} is deprecated; "
                      f"use zero_optimization.{new}"):
        cfg = load_config(zero(stage=stage, **{old: True}))
    assert getattr(cfg.zero_optimization, new).device == "cpu"
    assert getattr(cfg.zero_optimization, old) is None


@pytest.mark.parametrize("pin", [True, False])
def test_cpu_offload_use_pin_memory_maps_to_pin_memory(pin):
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load_config(zero(stage=3, cpu_offload=True, cpu_offload_param=True,
                               cpu_offload_use_pin_memory=pin))
    assert sum("cpu_offload_use_pin_memory is deprecated" in str(w.message) for w in record) == 1
    assert cfg.zero_optimization.offload_optimizer.pin_memory is pin
    assert cfg.zero_optimization.offload_param.pin_memory is pin


def test_cpu_offload_use_pin_memory_without_offload_warns_no_effect():
    with pytest.warns(ConfigWarning) as record:
        load_config(zero(stage=2, cpu_offload_use_pin_memory=False))
    kinds = sorted((type(w.message).__name__, "no effect" in str(w.message)) for w in record)
    assert kinds == [("ConfigDeprecationWarning", False), ("ConfigWarning", True)]


def test_cpu_offload_use_pin_memory_conflicting_with_pin_memory():
    err = error_of(zero(stage=2, cpu_offload_use_pin_memory=False,
                        offload_optimizer={"device": "cpu", "pin_memory": True}))
    assert err.paths == ["zero_optimization.cpu_offload_use_pin_memory"]


def test_deprecated_switch_true_next_to_replacement_is_an_error():
    err = error_of(zero(stage=2, cpu_offload=True, offload_optimizer={"device": "cpu"}))
    assert err.paths == ["zero_optimization.cpu_offload"] and "replacement" in str(err)


def test_deprecated_switch_false_next_to_replacement_is_dropped():
    with pytest.warns(ConfigDeprecationWarning):
        cfg = load_config(zero(stage=2, cpu_offload=False, offload_optimizer={"device": "cpu"}))
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_deprecated_switch_with_wrong_type():
    assert error_of(zero(stage=2, cpu_offload="yes")).paths == ["zero_optimization.cpu_offload"]


def test_gather_fp16_weights_maps_to_16bit_name():
    with pytest.warns(ConfigDeprecationWarning, match="gather_16bit_weights_on_model_save"):
        cfg = load_config(zero(stage=3, stage3_gather_fp16_weights_on_model_save=True))
    assert cfg.zero_optimization.gather_16bit_weights_on_model_save is True
    err = error_of(zero(stage=3, stage3_gather_fp16_weights_on_model_save=True,
                        stage3_gather_16bit_weights_on_model_save=False))
    assert "zero_optimization.stage3_gather_fp16_weights_on_model_save" in err.paths


@pytest.mark.parametrize("legacy, size, stage, bucket", [(True, None, 1, 500_000_000),
                                                         (True, 2e8, 1, 200_000_000),
                                                         (False, None, 0, 500_000_000)])
def test_legacy_boolean_zero_optimization(legacy, size, stage, bucket):
    source = {"zero_optimization": legacy}
    if size is not None:
        source["allgather_size"] = size
    with pytest.warns(ConfigDeprecationWarning):
        cfg = load_config(source)
    assert (cfg.zero_optimization.stage, cfg.zero_optimization.allgather_bucket_size) == \
        (stage, bucket)


def test_allgather_size_without_legacy_form_is_an_error():
    assert error_of({"allgather_size": 10, **zero(stage=1)}).paths == ["allgather_size"]


# -- stage-3-only keys, unknown keys, sub-sections ---------------------------------------------


def test_stage3_only_keys_below_stage3_warn_once():
    with pytest.warns(ConfigWarning, match="only affect ZeRO stage 3") as record:
        load_config(zero(stage=2, stage3_max_live_parameters=1e9, sub_group_size=1e9))
    messages = [str(w.message) for w in record if "stage 3" in str(w.message)]
    assert len(messages) == 1 and "max_live_parameters" in messages[0]
    assert "sub_group_size" in messages[0]


def test_sub_group_size_below_stage3_counts_with_nvme_optimizer_offload(tmp_path):
    """It slices the stage-1/2 partition that NVMe offload swaps: no warning then, the others still."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    with pytest.warns(ConfigWarning, match="only affect ZeRO stage 3") as record:
        load_config(zero(stage=2, sub_group_size=1e7, stage3_max_live_parameters=1e9, offload_optimizer=nvme))
    messages = [str(w.message) for w in record if "stage 3" in str(w.message)]
    assert len(messages) == 1 and "max_live_parameters" in messages[0] and "sub_group_size" not in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(zero(stage=1, sub_group_size=1e7, offload_optimizer=nvme))


def test_stage3_only_keys_at_stage3_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(zero(stage=3, stage3_max_live_parameters=1e9))


@pytest.mark.parametrize("section, typo, fix", [
    (None, "stage3_prefetch_bucket", "stage3_prefetch_bucket_size"),
    (None, "overlap_com", "overlap_comm"),
    (None, "offload_params", "offload_param"),
    (None, "stage3_max_live_params", "stage3_max_live_parameters"),
    (None, "contigous_gradients", "contiguous_gradients"),
    ("offload_param", "pin_memroy", "pin_memory"),
    ("offload_optimizer", "devices", "device"),
    ("offload_optimizer", "pipeline_reads", "pipeline_read"),
    ("leaf_module", "class", "classes"),
    ("zenflow", "topk_ration", "topk_ratio"),
])
def test_unknown_key_suggests_the_closest(section, typo, fix):
    keys = {typo: 1} if section is None else {section: {typo: 1}}
    err = error_of(zero(stage=3, **keys))
    where = "zero_optimization" + (f".{section}" if section else "")
    assert err.paths == [f"{where}.{typo}"]
    assert f"did you mean {fix!r}?" in str(err)


def test_leaf_module_coerces_strings_and_dedupes():
    leaf = load_config(zero(stage=3, leaf_module={"classes": "a.B", "names": ["x", "x", "y"]}))\
        .zero_optimization.leaf_module
    assert (leaf.classes, leaf.names, leaf.name_suffixes) == (["a.B"], ["x", "y"], [])


@pytest.mark.parametrize("value, ok", [({"select_strategy": "step", "select_interval": 4}, True),
                                       ({"select_strategy": "often"}, False),
                                       ({"update_interval": "sometimes"}, False),
                                       ({"topk_ratio": 2}, False)])
def test_zenflow(value, ok):
    source = zero(stage=2, zenflow=value)
    if ok:
        assert load_config(source).zero_optimization.zenflow.select_interval == 4
    else:
        assert error_of(source).paths[0].startswith("zero_optimization.zenflow.")


def test_zeropp_loco_param_is_a_free_dict():
    cfg = load_config(zero(stage=3, zeropp_loco_param={"err_beta": 0.8, "reset_T": 1024}))
    assert cfg.zero_optimization.zeropp_loco_param == {"err_beta": 0.8, "reset_T": 1024}
