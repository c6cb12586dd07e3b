"""reject_unimplemented and the UNIMPLEMENTED table: every entry refuses its non-default value
with the key named, and nothing else is refused."""

import warnings

import pytest

from zero_ext.config import (UNIMPLEMENTED, ConfigError, UnimplementedFeatureError, load_config,
                             reject_unimplemented)

Z3 = {"stage": 3}

#: For each table entry: a valid config that sets the key to a refused value, and that value.
CASES = {
    "zero_optimization.offload_optimizer.super_offload": (
        {"zero_optimization": {**Z3, "offload_optimizer": {"device": "cpu",
                                                           "super_offload": True}}}, True),
    "zero_optimization.zeropp_loco_param": (
        {"zero_optimization": {**Z3, "zeropp_loco_param": {"err_beta": 0.8}}},
        {"err_beta": 0.8}),
    "zero_optimization.zenflow": ({"zero_optimization": {"stage": 2, "zenflow": {}}}, None),
    "zero_optimization.allgather_sequential": (
        {"zero_optimization": {**Z3, "stage3_allgather_sequential": True}}, True),
    "zero_optimization.round_robin_gradients": (
        {"zero_optimization": {"stage": 2, "round_robin_gradients": True}}, True),
    "zero_optimization.load_from_fp32_weights": (
        {"zero_optimization": {"stage": 1, "load_from_fp32_weights": False}}, False),
    "zero_optimization.ignore_unused_parameters": (
        {"zero_optimization": {"stage": 2, "ignore_unused_parameters": False}}, False),
    "zero_optimization.grad_hooks": ({"zero_optimization": {"stage": 1, "grad_hooks": False}},
                                     False),
    "fp16.enabled": ({"fp16": {"enabled": True}}, True),
    "fp16.auto_cast": ({"fp16": {"auto_cast": True}}, True),
    "fp16.fp16_master_weights_and_grads": (
        {"fp16": {"fp16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
        True),
    "data_types.grad_accum_dtype": ({"data_types": {"grad_accum_dtype": "fp32"}}, "fp32"),
    "communication_data_type": ({"communication_data_type": "fp32"}, "fp32"),
    "optimizer.type": ({"optimizer": {"type": "Lamb"}}, "lamb"),
    "optimizer.legacy_fusion": ({"optimizer": {"type": "AdamW", "legacy_fusion": True}}, True),
    "prescale_gradients": ({"prescale_gradients": True}, True),
    "gradient_predivide_factor": ({"gradient_predivide_factor": 2.0}, 2.0),
    "sparse_gradients": ({"sparse_gradients": True}, True),
    "disable_allgather": ({"disable_allgather": True}, True),
    "aio.use_gds": ({"aio": {"use_gds": True}}, True),
    "checkpoint.tag_validation": ({"checkpoint": {"tag_validation": "IGNORE"}}, "IGNORE"),
    "checkpoint.load_universal": ({"checkpoint": {"load_universal": True}}, True),
    "checkpoint.use_node_local_storage": ({"checkpoint": {"use_node_local_storage": True}}, True),
    "checkpoint.parallel_write.pipeline_stage": (
        {"checkpoint": {"parallel_write": {"pipeline_stage": True}}}, True),
    "checkpoint.checkpoint_serialization": (
        {"checkpoint": {"checkpoint_serialization": False}}, False),
    "checkpoint.writer": ({"checkpoint": {"writer": {"type": "python"}}}, None),
    "dataloader_drop_last": ({"dataloader_drop_last": True}, True),
    "graph_harvesting": ({"graph_harvesting": True}, True),
    "sequence_parallel_size": ({"sequence_parallel_size": 2}, 2),
    "data_parallel_size": ({"data_parallel_size": 2}, 2),
    "amp.enabled": ({"amp": {"enabled": True, "opt_level": "O2"}}, True),
    "elasticity.enabled": ({"elasticity": {"enabled": True}}, True),
    "compile.deepcompile": ({"compile": {"deepcompile": True}}, True),
    "hybrid_engine.enabled": ({"hybrid_engine": {"enabled": True}}, True),
    "progressive_layer_drop.enabled": ({"progressive_layer_drop": {"enabled": True}}, True),
    "curriculum_learning.enabled": ({"curriculum_learning": {"enabled": True}}, True),
    "data_efficiency.enabled": ({"data_efficiency": {"enabled": True}}, True),
    "quantize_training.enabled": ({"quantize_training": {"enabled": True}}, True),
    "compression_training": ({"compression_training": {"weight_quantization": {}}}, None),
    "weight_quantization": ({"weight_quantization": {"post_init_quant": {}}}, None),
    "tensor_parallel": ({"tensor_parallel": {"autotp_size": 2}}, None),
    "expert_parallel": ({"expert_parallel": {"enabled": True}}, None),
}


def load_quiet(source):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(source)


def test_every_table_entry_has_a_case():
    assert set(CASES) == set(UNIMPLEMENTED)


@pytest.mark.parametrize("path", sorted(CASES))
def test_entry_refuses_its_value_and_names_it(path):
    source, value = CASES[path]
    cfg = load_quiet(source)
    with pytest.raises(UnimplementedFeatureError) as info:
        reject_unimplemented(cfg)
    problem = next(p for p in info.value.problems if p.path == path)
    assert "zero_ext does not implement" in problem.message
    if value is not None:
        assert problem.value == value
    assert path in str(info.value)


@pytest.mark.parametrize("path", sorted(CASES))
def test_implemented_lets_the_entry_through(path):
    cfg = load_quiet(CASES[path][0])
    others = [p.path for p in _problems(cfg) if p.path != path]
    reject_unimplemented(cfg, implemented=[path, *others])


def _problems(cfg):
    try:
        reject_unimplemented(cfg)
    except UnimplementedFeatureError as err:
        return err.problems
    return []


@pytest.mark.parametrize("source", [{}, {"zero_optimization": {"stage": 2}},
                                    {"zero_optimization": {"stage": 1, "offload_param": {}}},
                                    {"bf16": {"enabled": True}, "gradient_clipping": 0.5},
                                    {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
                                    {"fp16": {"enabled": False}, "wandb": {"enabled": True},
                                     "checkpoint": {"tag_validation": "warn"}}])
def test_implemented_features_pass(source):
    reject_unimplemented(load_quiet(source))


@pytest.mark.parametrize("kind, refused", [("AdamW", False), ("Adam", False), ("Lamb", True), ("Lion", False), ("OneBitAdam", True)])
def test_value_entries_refuse_only_their_values(kind, refused):
    problems = _problems(load_config({"optimizer": {"type": kind}}))
    assert (["optimizer.type"] if refused else []) == [p.path for p in problems]


def test_error_is_a_config_error_and_says_how_to_fix():
    with pytest.raises(ConfigError) as info:
        reject_unimplemented({"sparse_gradients": True})
    assert str(info.value).startswith("DeepSpeed config uses a feature zero_ext does not "
                                      "implement yet: sparse_gradients: got true;")
    assert str(info.value).endswith("remove the key or use the default false")


def test_unknown_implemented_key_is_a_programming_error():
    with pytest.raises(ValueError, match="zero_optimization.stgae"):
        reject_unimplemented(load_config({}), implemented=["zero_optimization.stgae"])


def test_table_is_plain_editable_data():
    for path, entry in UNIMPLEMENTED.items():
        assert isinstance(path, str) and path == path.strip()
        assert isinstance(entry, str) or (set(entry) == {"reason", "values"}
                                          and isinstance(entry["values"], list))
