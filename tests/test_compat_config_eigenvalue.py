"""DeepSpeedConfig's eigenvalue_* attributes (MoQ's eigenvalue settings): read from
quantize_training.eigenvalue only when quantize_training is on, else DeepSpeed's defaults; eigenvalue on
is refused as DeepSpeed refuses it."""
import pytest

from zero_ext.config import ConfigError
from zero_ext.runtime.config import DeepSpeedConfig

BASE = {"train_micro_batch_size_per_gpu": 1}
DEFAULTS = {"eigenvalue_enabled": False, "eigenvalue_verbose": False, "eigenvalue_max_iter": 100,
            "eigenvalue_tol": 1e-2, "eigenvalue_stability": 1e-6, "eigenvalue_gas_boundary_resolution": 1,
            "eigenvalue_layer_name": "bert.encoder.layer", "eigenvalue_layer_num": 0}


def _attrs(cfg):
    return {name: getattr(cfg, name) for name in DEFAULTS}


@pytest.mark.parametrize("extra", [{}, {"compression_training": {"weight_quantization": {
    "shared_parameters": {"enabled": True}, "different_groups": {}}}},
    {"quantize_training": {"enabled": False, "eigenvalue": {"enabled": True, "max_iter": 3}}}])
def test_defaults_without_quantize_training(extra):
    assert _attrs(DeepSpeedConfig({**BASE, **extra})) == DEFAULTS


def test_settings_read_with_quantize_training_on():
    cfg = DeepSpeedConfig({**BASE, "quantize_training": {"enabled": True, "eigenvalue": {
        "verbose": True, "max_iter": 7, "layer_name": "model.layers", "layer_num": 4}}})
    assert _attrs(cfg) == {**DEFAULTS, "eigenvalue_verbose": True, "eigenvalue_max_iter": 7,
                           "eigenvalue_layer_name": "model.layers", "eigenvalue_layer_num": 4}


def test_eigenvalue_on_is_refused_as_deepspeed_does():
    with pytest.raises(AssertionError, match="quantize_training.eigenvalue.enabled"):
        DeepSpeedConfig({**BASE, "quantize_training": {"enabled": True, "eigenvalue": {"enabled": True}}})
    with pytest.raises(ConfigError):
        DeepSpeedConfig({**BASE, "quantize_training": {"enabled": True, "eigenvalue": {"enabled": True}}})
