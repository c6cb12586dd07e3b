"""Top-level keys and sections: batch arithmetic, fp16/bf16, optimizer, scheduler, aio,
checkpoint, data types, reduction rules, ignored sections, unknown keys.

Expected defaults are DeepSpeed 0.19.6's (runtime/constants.py, precision_config.py,
swap_tensor/constants.py, lr_schedules.py), written here independently of zero_ext.
"""

import warnings

import pytest

from zero_ext.config import ConfigError, ConfigWarning, DeepSpeedConfig, load_config

DS_TOP_DEFAULTS = {
    "train_batch_size": None, "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None, "managed_gradient_accumulation": True,
    "gradient_clipping": 1.0, "prescale_gradients": False, "gradient_predivide_factor": 1.0,
    "gradient_allreduce_op": "mean", "communication_data_type": None,
    "seq_parallel_communication_data_type": "fp32", "sparse_gradients": False,
    "disable_allgather": False, "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True, "steps_per_print": None, "wall_clock_breakdown": False, "log_level": None,
    "dataloader_drop_last": False, "graph_harvesting": False,
    "use_data_before_expert_parallelism": False, "sequence_parallel_size": None,
    "data_parallel_size": None, "optimizer": None, "scheduler": None, "allgather_size": None,
    "compression_training": None, "weight_quantization": None, "tensor_parallel": None,
    "expert_parallel": None,
}
DS_SECTION_DEFAULTS = {
    "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False,
                                 "number_checkpoints": None, "cpu_checkpointing": False,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
    "fp16": {"enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
             "min_loss_scale": 1, "fp16_master_weights_and_grads": False},
    "bf16": {"enabled": False, "immediate_grad_update": False, "check_grad_overflow": True,
             "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False},
    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
            "single_submit": False, "overlap_events": True, "use_gds": False},
    "checkpoint": {"tag_validation": "WARN", "load_universal": False,
                   "use_node_local_storage": False, "checkpoint_serialization": True,
                   "writer": None},
    "data_types": {"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None},
}


def load_quiet(source, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(source, **kw)


def error_of(source, **kw):
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(source, **kw)
    return info.value


# -- defaults ------------------------------------------------------------------------------------


def test_every_scalar_top_level_key_has_an_expected_default():
    sections = {"zero_optimization", "fp16", "bf16", "aio", "checkpoint", "data_types", "amp", "activation_checkpointing",
                "torch_autocast", "elasticity", "compile", "hybrid_engine",
                "progressive_layer_drop", "curriculum_learning", "data_efficiency",
                "quantize_training"}
    assert set(DeepSpeedConfig.model_fields) - sections == set(DS_TOP_DEFAULTS)


@pytest.mark.parametrize("key", sorted(DS_TOP_DEFAULTS))
def test_top_level_default(key):
    assert getattr(load_config({}), key) == DS_TOP_DEFAULTS[key]


@pytest.mark.parametrize("section, key", [(s, k) for s, d in DS_SECTION_DEFAULTS.items()
                                          for k in d])
def test_section_default(section, key):
    assert getattr(getattr(load_config({}), section), key) == DS_SECTION_DEFAULTS[section][key]


# -- batch arithmetic ----------------------------------------------------------------------------


@pytest.mark.parametrize("given, ws, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
    ({"train_batch_size": 24}, 3, (24, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 6}, 4, (24, 6, 1)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": "auto"}, 8, (8, 1, 1)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 3}, 4, (24, 2, 3)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": 2}, 4, (64, 8, 2)),
    ({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4}, 2, (8, 1, 4)),
])
def test_batch_triple_is_derived(given, ws, expected):
    cfg = load_config(given, world_size=ws)
    triple = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
              cfg.gradient_accumulation_steps)
    assert triple == expected
    later = load_config(given)
    assert later.resolve_batch(ws) == expected and later.world_size == ws


@pytest.mark.parametrize("given, ws, words", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 3, "32 != 4 * 2 * 3 = 24"),
    ({"train_batch_size": 36, "train_micro_batch_size_per_gpu": 4}, 2,
     "divisible by train_micro_batch_size_per_gpu (4) * world_size (2) = 8"),
    ({"train_batch_size": 10}, 4, "divisible by world_size (4) = 4"),
    ({"gradient_accumulation_steps": 4}, 2, "give train_batch_size or"),
    ({}, 1, "give train_batch_size or"),
])
def test_batch_errors_show_the_numbers(given, ws, words):
    err = error_of(given, world_size=ws)
    assert err.paths == ["train_batch_size"] and words in str(err)


def test_impossible_triple_is_reported_before_the_world_size_is_known():
    err = error_of({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": 1})
    assert "multiple of" in str(err) and "= 4" in str(err)


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_accumulation_steps"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_batch_values_must_be_positive_integers(key, bad):
    assert error_of({key: bad}).paths == [key]


@pytest.mark.parametrize("ws", [0, -1, 1.0, True])
def test_world_size_must_be_a_positive_int(ws):
    cfg = load_config({"train_batch_size": 8})
    with pytest.raises(ConfigError, match="world_size"):
        cfg.resolve_batch(ws)


def test_resolve_batch_again_rederives_from_the_given_values():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "train_batch_size": "auto"})
    assert cfg.resolve_batch(2) == (4, 2, 1)
    assert cfg.resolve_batch(4) == (8, 2, 1)
    assert cfg.auto_resolved["train_batch_size"] == 8


# -- precision -----------------------------------------------------------------------------------


def test_bfloat16_is_an_alias_of_bf16():
    assert load_config({"bfloat16": {"enabled": True}}).bf16.enabled is True
    assert "given twice" in str(error_of({"bf16": {}, "bfloat16": {"enabled": True}}))


@pytest.mark.parametrize("source, path, words", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled",
     "cannot both be enabled"),
    ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale", ">= 0"),
    ({"fp16": {"loss_scale": True}}, "fp16.loss_scale", "not a boolean"),
    ({"fp16": {"loss_scale": []}}, "fp16.loss_scale", "must be a number, not a list"),
    ({"zero_optimization": {"reduce_bucket_size": {}}}, "zero_optimization.reduce_bucket_size",
     "must be a number, not a dict"),
    ({"fp16": {"loss_scale": float("inf")}}, "fp16.loss_scale", "finite"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window", "> 0"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale", "> 0"),
    ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis", ">= 1"),
    ({"fp16": {"initial_scale_power": -1}}, "fp16.initial_scale_power", ">= 0"),
    ({"bf16": {"bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states",
     "bf16_master_weights_and_grads"),
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads",
     "stage 1, 2 or 3"),
    ({"fp16": {"enabeld": True}}, "fp16.enabeld", "did you mean 'enabled'?"),
])
def test_precision_errors(source, path, words):
    err = error_of(source)
    assert err.paths == [path] and words in str(err)


def test_static_loss_scale_does_not_check_dynamic_settings():
    cfg = load_config({"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}})
    assert cfg.fp16.loss_scale == 128 and not cfg.fp16.dynamic_loss_scale
    assert cfg.precision == "fp16"


@pytest.mark.parametrize("spelling, canonical", [("fp32", "fp32"), ("float32", "fp32"),
                                                 ("BF16", "bf16"), ("bfloat16", "bf16"),
                                                 ("half", "fp16"), ("torch.float16", "fp16")])
def test_grad_accum_dtype_spellings(spelling, canonical):
    assert load_config({"data_types": {"grad_accum_dtype": spelling}}).data_types\
        .grad_accum_dtype == canonical


@pytest.mark.parametrize("source, path", [({"data_types": {"grad_accum_dtype": "int8"}},
                                           "data_types.grad_accum_dtype"),
                                          ({"communication_data_type": "int8"},
                                           "communication_data_type"),
                                          ({"gradient_allreduce_op": "max"},
                                           "gradient_allreduce_op"),
                                          ({"checkpoint": {"tag_validation": "STRICT"}},
                                           "checkpoint.tag_validation")])
def test_choice_errors(source, path):
    assert error_of(source).paths == [path]


def test_case_insensitive_choices():
    cfg = load_config({"communication_data_type": "BF16", "gradient_allreduce_op": "MEAN",
                       "checkpoint": {"tag_validation": "fail", "load_universal": True}})
    assert (cfg.communication_data_type, cfg.gradient_allreduce_op,
            cfg.checkpoint.tag_validation, cfg.checkpoint.load_universal) == \
        ("bf16", "mean", "FAIL", True)


# -- reduction rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("source, path, ok", [
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
     "gradient_allreduce_op", False),
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 2}}, None, True),
    ({"gradient_allreduce_op": "sum", "compile": {"deepcompile": True}},
     "gradient_allreduce_op", False),
    ({"gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 2}},
     "gradient_predivide_factor", False),
    ({"gradient_predivide_factor": 2.0,
      "zero_optimization": {"stage": 2, "reduce_scatter": False}}, None, True),
    ({"prescale_gradients": True, "zero_optimization": {"stage": 3}}, "prescale_gradients",
     False),
    ({"prescale_gradients": True, "zero_optimization": {"stage": 1}}, None, True),
])
def test_reduction_rules(source, path, ok):
    if ok:
        assert load_quiet(source).zero_optimization.stage == source["zero_optimization"]["stage"]
    else:
        assert error_of(source).paths == [path]


# -- aio -------------------------------------------------------------------------------------------


def test_aio_thread_count_is_an_alias_of_intra_op_parallelism():
    assert load_config({"aio": {"thread_count": 4}}).aio.intra_op_parallelism == 4
    err = error_of({"aio": {"thread_count": 4, "intra_op_parallelism": 2}})
    assert "given twice" in str(err)


@pytest.mark.parametrize("value, path, words", [({"queue_depth": 0}, "aio.queue_depth", "> 0"),
                                                ({"block_sise": 4096}, "aio.block_sise",
                                                 "did you mean 'block_size'?"),
                                                ({"single_submit": 3}, "aio.single_submit",
                                                 "true or false")])
def test_aio_errors(value, path, words):
    err = error_of({"aio": value})
    assert err.paths == [path] and words in str(err)


# -- unknown keys and ignored sections ---------------------------------------------------------


@pytest.mark.parametrize("key, words", [
    ("train_batch_sise", "did you mean 'train_batch_size'?"),
    ("gradient_cliping", "did you mean 'gradient_clipping'?"),
    ("zero_optimisation", "did you mean 'zero_optimization'?"),
    ("stage3_max_live_parameters", "belongs in zero_optimization"),
    ("offload_param", "belongs in zero_optimization"),
    ("loss_scale_window", "belongs in fp16"),
    ("xyzzy", "valid keys are"),
])
def test_unknown_top_level_keys(key, words):
    err = error_of({key: 1})
    assert err.paths == [key] and words in str(err)


def test_all_problems_are_reported_together():
    err = error_of({"zero_optimization": {"stage": 4, "overlap_com": True},
                    "fp16": {"loss_scale": -1}, "optimiser": {}})
    assert sorted(err.paths) == ["fp16.loss_scale", "optimiser", "zero_optimization.overlap_com",
                                 "zero_optimization.stage"]
    assert "4 problems" in str(err)


def test_ignored_sections_give_one_warning_and_are_kept():
    source = {"tensorboard": {"enabled": True}, "flops_profiler": {"enabled": True},
              "wandb": {"enabled": False}, "comms_logger": {"enabled": True}}
    with pytest.warns(ConfigWarning) as record:
        cfg = load_config({**source, "activation_checkpointing": {"cpu_checkpointing": True}})
    assert len(record) == 1
    message = str(record[0].message)
    assert "tensorboard" in message and "flops_profiler" in message and "comms_logger" in message
    assert "activation_checkpointing" not in message and "wandb" not in message  # (a section zero_ext honours)
    assert cfg.ignored_sections == source and cfg.activation_checkpointing.cpu_checkpointing


def test_disabled_ignored_sections_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"wandb": {"enabled": False}, "comms_logger": {"enabled": False}})


@pytest.mark.parametrize("source, attr", [({"amp": {"enabled": True, "opt_level": "O1"}}, "amp"),
                                          ({"elasticity": {"enabled": True, "max_gpus": 8}},
                                           "elasticity"),
                                          ({"compile": {"deepcompile": True, "passes": []}},
                                           "compile")])
def test_feature_sections_load_with_their_own_keys(source, attr):
    section = getattr(load_config(source), attr)
    assert (section.deepcompile if attr == "compile" else section.enabled) is True


def test_steps_per_print_infinity_means_never():
    # accelerate writes float("inf") there to silence DeepSpeed's progress log
    assert load_config({"train_batch_size": 1, "steps_per_print": float("inf")}).steps_per_print is None
    with pytest.raises(ConfigError, match="steps_per_print"):
        load_config({"train_batch_size": 1, "steps_per_print": float("nan")})


def test_get_reads_the_config_as_given_and_batch_keys_resolved():
    # DeepSpeed's engine.config is the user's dict; transformers calls .get on it
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}, world_size=2)
    assert cfg.get("zero_optimization", {}).get("stage") == 2
    assert cfg.get("train_batch_size") == 4 and cfg.get("absent", "x") == "x"
