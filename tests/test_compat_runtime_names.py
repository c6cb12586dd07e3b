"""DeepSpeed's logging helpers, the ``log_level`` config key and the name constants scripts import
(``deepspeed.runtime.config`` / ``.constants`` / ``.lr_schedules``), over zero_ext."""
import logging

import pytest

from helpers.compat_site import import_checkout_compat
from helpers.harness import run_ranks


@pytest.fixture(scope="module")
def ds():
    return import_checkout_compat()


@pytest.fixture
def zero_ext_logger():
    log = logging.getLogger("zero_ext")
    saved = log.level
    yield log
    log.setLevel(saved)


def test_level_from_string_any_case_and_refusal(ds, zero_ext_logger):
    from deepspeed.utils import get_log_level_from_string, set_log_level_from_string

    assert get_log_level_from_string("Info") == logging.INFO
    set_log_level_from_string("ERROR")
    assert zero_ext_logger.level == logging.ERROR
    other = logging.getLogger("test_compat_runtime_names.other")
    handler = logging.StreamHandler()
    other.addHandler(handler)
    set_log_level_from_string("debug", custom_logger=other)
    assert other.level == handler.level == logging.DEBUG
    other.removeHandler(handler)
    with pytest.raises(ValueError, match="verbose.*debug, info, warning, error, critical"):
        set_log_level_from_string("verbose")
    assert ds.utils.logging.should_log_le("error") and not ds.utils.logging.should_log_le("warning")


def _engine_log_level(level):
    import torch

    import zero_ext

    logging.getLogger("zero_ext").setLevel(logging.DEBUG)
    config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if level is not None:
        config["log_level"] = level
    engine, *_ = zero_ext.initialize(model=torch.nn.Linear(4, 4), config=config)
    out = engine.log_level(), logging.getLogger("zero_ext").getEffectiveLevel()
    engine.destroy()
    return out


def test_config_log_level_sets_the_logger_when_the_engine_is_built():
    assert run_ranks(1, _engine_log_level, "ERROR")[0] == ("ERROR", logging.ERROR)
    assert run_ranks(1, _engine_log_level, None)[0] == (None, logging.DEBUG)  # absent: left as it was


def test_config_log_level_refuses_an_unknown_level():
    from zero_ext.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="log_level.*debug, info"):
        load_config({"train_batch_size": 1, "log_level": "loud"})


def test_name_constants(ds):
    from deepspeed.runtime.config import ADAM_OPTIMIZER, ADAMW_OPTIMIZER, DEEPSPEED_OPTIMIZERS, get_log_level
    from deepspeed.runtime.constants import LOG_LEVEL, LOG_LEVEL_DEFAULT, TRAIN_BATCH_SIZE
    from deepspeed.runtime.lr_schedules import CYCLE_MAX_LR, CYCLE_MIN_LR, ONE_CYCLE, OneCycle

    assert (ADAM_OPTIMIZER, ADAMW_OPTIMIZER) == ("adam", "adamw") and "lion" in DEEPSPEED_OPTIMIZERS
    assert get_log_level({}) is LOG_LEVEL_DEFAULT is None and get_log_level({LOG_LEVEL: "INFO"}) == "INFO"
    assert TRAIN_BATCH_SIZE == "train_batch_size" and ONE_CYCLE == OneCycle.__name__
    assert (CYCLE_MIN_LR, CYCLE_MAX_LR) == ("cycle_min_lr", "cycle_max_lr")


def _optimizer_classes():
    import torch

    import deepspeed
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer

    out = {}
    for stage, fp16 in ((0, False), (1, False), (3, False), (2, True)):
        config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage}, "fp16": {"enabled": fp16}}
        engine, opt, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 4), config=config)
        out[(stage, fp16)] = (isinstance(opt, ZeROOptimizer), isinstance(opt, DeepSpeedOptimizer),
                              getattr(opt, "needs_scaler", lambda: None)())
        engine.destroy()
    return out


def _with_compat(fn):
    import os
    import sys

    from helpers import ROOT

    if os.path.join(ROOT, "compat") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "compat"))
    return fn()


def test_optimizer_base_classes_and_needs_scaler():
    out = run_ranks(1, _with_compat, _optimizer_classes)[0]
    # stage 0 over fp32: the base optimizer itself, a torch one, as DeepSpeed hands out
    assert out == {(0, False): (False, False, None), (1, False): (True, True, False),
                   (3, False): (True, True, False), (2, True): (True, True, True)}


def test_see_memory_usage_logs_only_when_forced(ds, caplog):
    from deepspeed.runtime.utils import see_memory_usage

    with caplog.at_level(logging.INFO, logger="zero_ext"):
        see_memory_usage("quiet")
        see_memory_usage("after init", force=True)
    lines = [r.getMessage() for r in caplog.records]
    assert "quiet" not in lines and lines[0] == "after init"
    assert lines[1].startswith("MA ") and "Max_MA" in lines[1]
