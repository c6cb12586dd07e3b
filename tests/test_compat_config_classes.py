"""DeepSpeed's config classes built directly, as DeepSpeed's own code, its tests and libraries build them
(``DeepSpeedZeroConfig(**section)``, ``DeepSpeedZeroOffloadOptimizerConfig(**section)``,
``get_bfloat16_config(param_dict)``, ``DeepSpeedConfig._configure_train_batch_size``): the same aliases,
deprecated keys and errors as a config loaded whole. The checkout's compat/ is imported first."""
import os
import warnings

import pytest
from pydantic import ValidationError

from helpers import ROOT
from helpers.compat_site import import_checkout_compat

COMPAT = os.path.join(ROOT, "compat")


@pytest.fixture(scope="module")
def ds():
    return import_checkout_compat()


@pytest.mark.parametrize("key,field", [("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
                                       ("stage3_param_persistence_threshold", "param_persistence_threshold"),
                                       ("stage3_max_live_parameters", "max_live_parameters"),
                                       ("stage3_max_reuse_distance", "max_reuse_distance"),
                                       ("stage3_module_granularity_threshold", "module_granularity_threshold")])
def test_a_section_built_directly_takes_deepspeeds_aliases(ds, key, field):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from zero_ext.config import load_config

    direct = DeepSpeedZeroConfig(**{"stage": 3, key: 4321})
    assert getattr(direct, field) == 4321
    loaded = load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, key: 4321}}).zero_optimization
    assert direct == loaded  # the same section, however it was built


def test_deprecated_keys_migrate_with_a_warning_when_built_directly(ds):
    from deepspeed.runtime.zero.config import (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig,
                                               DeepSpeedZeroOffloadParamConfig)

    from zero_ext.config import ConfigDeprecationWarning

    with pytest.warns(ConfigDeprecationWarning, match="cpu_offload is deprecated; use offload_optimizer"):
        z = DeepSpeedZeroConfig(**{"stage": 2, "cpu_offload": True})
    assert isinstance(z.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig) and z.offload_optimizer.device == "cpu"
    with pytest.warns(ConfigDeprecationWarning, match="cpu_offload_param is deprecated"):
        z = DeepSpeedZeroConfig(**{"stage": 3, "cpu_offload_param": True})
    assert isinstance(z.offload_param, DeepSpeedZeroOffloadParamConfig) and z.offload_param.device == "cpu"
    for old in ("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigDeprecationWarning)
            assert DeepSpeedZeroConfig(**{old: True}).gather_16bit_weights_on_model_save is True
    # nested sections are walked too, and "auto" means the default as in a loaded config
    z = DeepSpeedZeroConfig(**{"stage": 3, "stage3_prefetch_bucket_size": "auto",
                               "offload_optimizer": {"device": "cpu", "pin_memory": False}})
    assert z.prefetch_bucket_size == DeepSpeedZeroConfig().prefetch_bucket_size and not z.offload_optimizer.pin_memory
    for read, write, on in ((False, False, False), (True, False, True), (False, True, True)):
        assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_read=read, pipeline_write=write).pipeline is on


def test_mistakes_in_a_section_built_directly_are_named(ds):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    with pytest.raises(ValidationError, match="did you mean 'stage3_prefetch_bucket_size'"):
        DeepSpeedZeroConfig(stage3_prefetch_bucket=5)
    with pytest.raises(ValidationError, match="as 'prefetch_bucket_size' and as its alias"):
        DeepSpeedZeroConfig(prefetch_bucket_size=1, stage3_prefetch_bucket_size=2)
    with pytest.raises(ValidationError, match="buffer_count: must be >= 1"):
        DeepSpeedZeroConfig(stage=1, offload_optimizer={"device": "nvme", "nvme_path": "/tmp", "buffer_count": 0})
    z = DeepSpeedZeroConfig(stage=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an assignment is not walked again: no deprecation warnings
        z.stage = 3
    assert z.stage == 3


def test_precision_sections_from_a_param_dict(ds):
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    assert get_bfloat16_config({"bf16": {"enabled": True}}).enabled
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled  # DeepSpeed's older name
    assert not get_bfloat16_config({}).enabled
    fp16 = get_float16_config({"fp16": {"enabled": True, "initial_scale_power": 8}})
    assert fp16.enabled and fp16.initial_dynamic_scale == 256.0
    with pytest.raises(ValueError, match="both 'bf16' and its older name"):
        get_bfloat16_config({"bf16": {}, "bfloat16": {}})


@pytest.mark.parametrize("train,micro,gas,ok", [(32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False),
                                                (32, 18, 1, False)])
def test_configure_train_batch_size_rederives_the_triple(ds, train, micro, gas, ok):
    from deepspeed.runtime.config import DeepSpeedConfig

    class TwoRanks:
        def get_data_parallel_world_size(self):
            return 2

    cfg = DeepSpeedConfig({"train_batch_size": 2}, mpu=TwoRanks())
    # all three given, then two of them (the third derived)
    given = [(train, micro, gas), (train, micro, None)] + ([(train, None, gas), (None, micro, gas)] if ok else [])
    for t, m, g in given:
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = t, m, g
        if ok:
            cfg._configure_train_batch_size()
            assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
                (train, micro, gas)
        else:
            with pytest.raises(AssertionError, match="train_batch_size"):  # DeepSpeed asserts here
                cfg._configure_train_batch_size()


def test_a_library_section_on_deepspeeds_config_base_class(ds, caplog):
    from typing import List, Optional

    from deepspeed.runtime.config_utils import DeepSpeedConfigModel, get_scalar_param
    from pydantic import Field

    class Retrieval(DeepSpeedConfigModel):  # a section as a library defines one
        top_k: int = 4
        index_names: Optional[List[str]] = None
        index_name: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "index_names",
                                                                   "new_param_fn": lambda v: [v]})
        batch: int = Field(8, alias="batch_size")

    assert Retrieval(top_k=2).top_k == 2
    assert Retrieval(batch_size=3).batch == 3 and Retrieval(batch=3).batch == 3  # name or alias
    assert Retrieval(top_k="auto").top_k == 4  # "auto": the default
    with caplog.at_level("WARNING", logger="zero_ext"):
        assert Retrieval(index_name="wiki").index_names == ["wiki"]
    assert "index_name is deprecated; use index_names" in caplog.text
    with pytest.raises(AssertionError, match="both given"):
        Retrieval(index_name="wiki", index_names=["web"])
    for bad in ({"top_k": "many"}, {"top_kk": 1}):
        with pytest.raises(ValidationError):
            Retrieval(**bad)
    with pytest.raises(ValidationError):
        Retrieval(strict=True, top_k="auto")
    assert get_scalar_param({"a": 1}, "a", 0) == 1 and get_scalar_param({}, "a", 0) == 0


def test_a_section_built_alone_is_checked_key_by_key_and_its_combinations_when_loaded(ds):
    # DeepSpeed builds the section without a stage (0) next to stage-3-only keys; the combination is refused
    # where the config is used: by load_config (initialize) and by a later assignment to the section.
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from zero_ext.config import ConfigDeprecationWarning, ConfigError, load_config

    with pytest.warns(ConfigDeprecationWarning):
        z = DeepSpeedZeroConfig(**{"cpu_offload_param": True})
    assert z.stage == 0 and z.offload_param.device == "cpu"
    z.stage = 3
    assert z.stage == 3
    with pytest.raises(ConfigError, match="partial offload .* only supported with ZeRO stage 3"):
        z.offload_optimizer = {"device": "cpu", "ratio": 0.5}
        z.stage = 2
    with pytest.raises(ConfigError, match="partial offload .* only supported with ZeRO stage 3"):
        load_config({"train_batch_size": 1, "zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                                                        "ratio": 0.5}}})


def test_offload_sections_are_importable_from_offload_config_too(ds):
    # DeepSpeed defines them in runtime/zero/offload_config.py (its tests import them there: ratio, ...)
    from deepspeed.runtime.zero import config, offload_config

    assert offload_config.DeepSpeedZeroOffloadOptimizerConfig is config.DeepSpeedZeroOffloadOptimizerConfig
    assert offload_config.DeepSpeedZeroOffloadParamConfig is config.DeepSpeedZeroOffloadParamConfig
    assert offload_config.DeepSpeedZeroOffloadOptimizerConfig(ratio=0.3).ratio == 0.3
