"""optimizer and scheduler sections: type names, params checks, "auto" params.

Expected values follow DeepSpeed 0.19.6: engine._configure_basic_optimizer (names, adam_w_mode,
torch_adam, max_grad_norm), ops/adam FusedAdam/DeepSpeedCPUAdam defaults, lr_schedules.py.
"""

import warnings

import pytest

from zero_ext.config import ConfigError, load_config


def error_of(source):
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(source)
    return info.value


def optimizer(type_, **params):
    return {"optimizer": {"type": type_, "params": params}}


def scheduler(type_, **params):
    return {"scheduler": {"type": type_, "params": params}}


# -- optimizer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("given, stored", [("Adam", "adam"), ("ADAMW", "adamw"),
                                           ("AdamW", "adamw"), ("Lamb", "lamb"),
                                           ("lion", "lion"), ("Adagrad", "adagrad"),
                                           ("SGD", "SGD"), ("RMSprop", "RMSprop")])
def test_optimizer_type_names(given, stored):
    assert load_config(optimizer(given)).optimizer.type == stored


@pytest.mark.parametrize("given, fix", [("Adamm", "adam"), ("sgd", "SGD"), ("AdamW8bit", "adamw"),
                                        ("RMSProp", "RMSprop")])
def test_unknown_optimizer_type_suggests(given, fix):
    err = error_of(optimizer(given))
    # DeepSpeed's names are case-insensitive, so either spelling of the suggestion is right.
    assert err.paths == ["optimizer.type"]
    assert f"did you mean {fix!r}?".lower() in str(err).lower()


def test_optimizer_type_is_required():
    err = error_of({"optimizer": {"params": {"lr": 1}}})
    assert err.paths == ["optimizer.type"] and "is required" in str(err)


@pytest.mark.parametrize("params, path, words", [
    ({"weight_decy": 0.1}, "optimizer.params.weight_decy", "did you mean 'weight_decay'?"),
    ({"beta": [0.9, 0.99]}, "optimizer.params.beta", "did you mean 'betas'?"),
    ({"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm", "gradient_clipping"),
    ({"lr": -1}, "optimizer.params.lr", ">= 0"),
    ({"betas": [0.9, 1.5]}, "optimizer.params.betas", "[0, 1)"),
    ({"betas": [0.9]}, "optimizer.params.betas[1]", "is required"),
    ({"amsgrad": True}, "optimizer.params.amsgrad", "torch_adam"),
    ({"foreach": True}, "optimizer.params.foreach", "torch_adam"),
    ({"torch_adam": True, "set_grad_none": False}, "optimizer.params.set_grad_none",
     "fused Adam"),
])
def test_adam_params_errors(params, path, words):
    err = error_of(optimizer("AdamW", **params))
    assert err.paths == [path] and words in str(err)


def test_adam_params_keep_only_given_keys_with_checked_values():
    cfg = load_config(optimizer("Adam", lr=3e-4, betas=[0.8, 0.999], adam_w_mode=False))
    assert cfg.optimizer.params == {"lr": 3e-4, "betas": (0.8, 0.999), "adam_w_mode": False}
    assert cfg.optimizer.is_adam and cfg.optimizer.adam_w_mode is False


@pytest.mark.parametrize("type_, params, w_mode", [("Adam", {}, True),
                                                   ("Adam", {"adam_w_mode": False}, False),
                                                   ("AdamW", {"adam_w_mode": False}, True)])
def test_adam_w_mode_follows_deepspeed(type_, params, w_mode):
    # DeepSpeed: "Adam" with the default adam_w_mode=True behaves as AdamW; AdamW always does.
    assert load_config(optimizer(type_, **params)).optimizer.adam_w_mode is w_mode


def test_params_with_defaults_fills_deepspeed_adam_defaults():
    merged = load_config(optimizer("AdamW", lr=2e-4)).optimizer.params_with_defaults()
    assert (merged["lr"], merged["weight_decay"], merged["betas"], merged["eps"]) == \
        (2e-4, 0.0, (0.9, 0.999), 1e-8)
    assert "foreach" not in merged
    assert load_config(optimizer("SGD", lr=0.1)).optimizer.params_with_defaults() == {"lr": 0.1}


def test_torch_adam_accepts_torch_arguments():
    cfg = load_config(optimizer("AdamW", torch_adam=True, amsgrad=True, foreach=False))
    assert cfg.optimizer.params["amsgrad"] is True


def test_torch_optimizer_params_pass_through_but_max_grad_norm_does_not():
    assert load_config(optimizer("SGD", lr=0.1, momentum=0.9, nesterov=True)).optimizer.params \
        == {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    assert error_of(optimizer("SGD", max_grad_norm=1)).paths == ["optimizer.params.max_grad_norm"]


@pytest.mark.parametrize("stage, ok", [(0, True), (1, False), (3, False)])
def test_one_bit_optimizers_refuse_zero(stage, ok):
    source = {**optimizer("OneBitAdam"), "zero_optimization": {"stage": stage}}
    if ok:
        assert load_config(source).optimizer.type == "onebitadam"
    else:
        assert error_of(source).paths == ["optimizer.type"]


def test_auto_optimizer_params_resolve_to_deepspeed_adam_defaults():
    cfg = load_config(optimizer("AdamW", lr="auto", betas="auto", eps="auto",
                                weight_decay="auto"))
    assert cfg.optimizer.params == {}
    assert cfg.auto_resolved == {"optimizer.params.lr": 1e-3,
                                 "optimizer.params.betas": (0.9, 0.999),
                                 "optimizer.params.eps": 1e-8,
                                 "optimizer.params.weight_decay": 0.0}


# -- scheduler -----------------------------------------------------------------------------------


@pytest.mark.parametrize("type_, params", [
    ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500,
                  "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": [0.0, 1e-6], "warmup_max_lr": [1e-3, 1e-4]}),
    ("WarmupDecayLR", {"total_num_steps": 1e4, "warmup_num_steps": 100}),
    ("WarmupCosineLR", {"total_num_steps": 1000, "cos_min_ratio": 0.1,
                        "warmup_min_ratio": 0.01}),
    ("OneCycle", {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "cycle_first_step_size": 1000,
                  "cycle_momentum": False}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-5, "lr_range_test_step_size": 50,
                     "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}),
    ("StepLR", {"step_size": 10, "gamma": 0.5}),
    ("CosineAnnealingLR", {"T_max": 100}),
])
def test_schedulers_load(type_, params):
    cfg = load_config(scheduler(type_, **params))
    assert cfg.scheduler.type == type_ and set(cfg.scheduler.params) == set(params)


def test_scheduler_integers_accept_scientific_notation():
    assert load_config(scheduler("WarmupDecayLR", total_num_steps=1e4)).scheduler\
        .params["total_num_steps"] == 10000


@pytest.mark.parametrize("type_, params, path, words", [
    ("WarmupLR", {"warmup_num_step": 10}, "scheduler.params.warmup_num_step",
     "did you mean 'warmup_num_steps'?"),
    ("WarmupLR", {"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps", "> 0"),
    ("WarmupLR", {"warmup_type": "cosine"}, "scheduler.params.warmup_type", '"log" or "linear"'),
    ("WarmupLR", {"warmup_max_lr": "fast"}, "scheduler.params.warmup_max_lr", "number"),
    ("WarmupLR", {"warmup_min_lr": -1}, "scheduler.params.warmup_min_lr", ">= 0"),
    ("WarmupDecayLR", {"warmup_num_steps": 10}, "scheduler.params.total_num_steps",
     "required by WarmupDecayLR"),
    ("WarmupCosineLR", {}, "scheduler.params.total_num_steps", "required by WarmupCosineLR"),
    ("OneCycle", {"cycle_min_lr": 1e-5}, "scheduler.params.cycle_max_lr", "required by OneCycle"),
    ("LRRangeTest", {"lr_range_test_step_size": -5}, "scheduler.params.lr_range_test_step_size",
     "> 0"),
])
def test_scheduler_params_errors(type_, params, path, words):
    err = error_of(scheduler(type_, **params))
    assert err.paths == [path] and words in str(err)


@pytest.mark.parametrize("given, fix", [("WarmupLr", "WarmupLR"), ("warmup_lr", "WarmupLR"),
                                        ("CosineAnnealing", "CosineAnnealingLR")])
def test_unknown_scheduler_type_suggests(given, fix):
    err = error_of(scheduler(given))
    assert err.paths == ["scheduler.type"] and f"did you mean {fix!r}?" in str(err)


def test_auto_scheduler_params_resolve_to_defaults_and_required_auto_is_allowed():
    cfg = load_config(scheduler("WarmupDecayLR", warmup_min_lr="auto", warmup_max_lr="auto",
                                warmup_num_steps="auto", total_num_steps="auto"))
    assert cfg.scheduler.params == {}
    assert cfg.auto_resolved == {"scheduler.params.warmup_min_lr": 0.0,
                                 "scheduler.params.warmup_max_lr": 0.001,
                                 "scheduler.params.warmup_num_steps": 1000,
                                 "scheduler.params.total_num_steps": None}


def test_onecycle_momentum_may_be_given_per_group():
    cfg = load_config({"scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_min_mom": [0.8, 0.85], "cycle_max_mom": 0.9}}})
    assert cfg.scheduler.params["cycle_min_mom"] == [0.8, 0.85]


def test_torch_adam_beside_params_is_ignored_with_a_warning():
    # DeepSpeed reads torch_adam from optimizer.params only (its test_fp16 writes it beside them)
    with pytest.warns(UserWarning, match=r"optimizer.torch_adam = False is ignored.*move it into params"):
        cfg = load_config({"optimizer": {"type": "Adam", "torch_adam": False, "params": {"lr": 1e-3}}})
    assert cfg.optimizer.params == {"lr": 1e-3}
    with pytest.raises(ConfigError, match="optimizer.torch_adam"):
        load_config({"optimizer": {"type": "Adam", "torch_adam": "maybe"}})
