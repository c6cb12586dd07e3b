"""Values that used to load although wrong, or crash later with a bare exception: each is now a
ConfigError at load naming the key (issue 19, part 2)."""

import math
import warnings

import pytest

from zero_ext.config import ConfigError, load_config
from zero_ext.config.unimplemented import IMPLEMENTED_BY_INITIALIZE, UNIMPLEMENTED

NAN, INF = float("nan"), float("inf")


def load(cfg, world=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_config({"train_micro_batch_size_per_gpu": 1, **cfg})
    loaded.resolve_batch(world)
    return loaded


def refused(cfg, key, *words):
    with pytest.raises(ConfigError) as info:
        load(cfg)
    text = str(info.value)
    assert any(p == key or p.startswith(key + "[") for p in info.value.paths), text
    for word in words:
        assert word in text, text
    return text


# -- scheduler params ------------------------------------------------------------------------------

SCHEDULERS = {  # a valid params dict for each, and one lr-like and one integer key
    "WarmupLR": ({}, "warmup_max_lr", "warmup_num_steps"),
    "WarmupDecayLR": ({"total_num_steps": 100}, "warmup_max_lr", "warmup_num_steps"),
    "WarmupCosineLR": ({"total_num_steps": 100}, "warmup_min_ratio", "warmup_num_steps"),
    "OneCycle": ({"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}, "cycle_max_lr",
                 "cycle_first_step_size"),
    "LRRangeTest": ({}, "lr_range_test_min_lr", "lr_range_test_step_size"),
}


def sched(kind, **params):
    base = SCHEDULERS[kind][0]
    return {"scheduler": {"type": kind, "params": {**base, **params}}}


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize("value", [NAN, INF, -INF, "fast", True, [[0.1]], []],
                         ids=["nan", "inf", "-inf", "str", "bool", "nested", "empty"])
def test_scheduler_lr_values_must_be_finite_numbers(kind, value):
    key = SCHEDULERS[kind][1]
    refused(sched(kind, **{key: value}), f"scheduler.params.{key}")


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize("value", [0, -1, 1e30, 2 ** 64, 1.5, None, [10]],
                         ids=["zero", "neg", "1e30", "2**64", "frac", "null", "list"])
def test_scheduler_step_counts_are_positive_int64(kind, value):
    key = SCHEDULERS[kind][2]
    refused(sched(kind, **{key: value}), f"scheduler.params.{key}")


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_scheduler_misspelt_key_gets_a_suggestion(kind):
    key = SCHEDULERS[kind][2]
    typo = key.replace("_", "", 1)
    refused(sched(kind, **{typo: 10}), f"scheduler.params.{typo}", f"did you mean '{key}'")


def test_per_group_lr_list_stays_accepted_and_momentum_is_below_one():
    assert load(sched("WarmupLR", warmup_max_lr=[1e-3, 2e-3])).scheduler.params == {
        "warmup_max_lr": [1e-3, 2e-3]}
    refused(sched("OneCycle", cycle_max_mom=1.0), "scheduler.params.cycle_max_mom", "[0, 1)")
    refused(sched("OneCycle", decay_lr_rate=-0.5), "scheduler.params.decay_lr_rate", ">= 0")


def test_required_scheduler_param_given_as_null_is_named():
    refused(sched("WarmupDecayLR", total_num_steps=None), "scheduler.params.total_num_steps",
            "is required by WarmupDecayLR")


# -- optimizer params ------------------------------------------------------------------------------

def opt(kind, stage=0, offload=False, **params):
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"optimizer": {"type": kind, "params": params}, "zero_optimization": zero}


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "Adagrad", "Lion", "SGD", "RMSprop", "NAdam"])
def test_optimizer_misspelt_key_gets_a_suggestion(kind):
    refused(opt(kind, lr_=0.1), "optimizer.params.lr_", "did you mean 'lr'")


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "Adagrad", "Lion", "SGD", "Adamax", "RAdam"])
@pytest.mark.parametrize("lr", [NAN, INF, -1e-3, "fast", True], ids=["nan", "inf", "neg", "str", "bool"])
def test_optimizer_lr_must_be_a_finite_number_at_least_zero(kind, lr):
    refused(opt(kind, lr=lr), "optimizer.params.lr")


@pytest.mark.parametrize("kind", ["AdamW", "Lion", "Adamax", "NAdam", "SparseAdam"])
@pytest.mark.parametrize("betas", [[0.9, 1.0], [-0.1, 0.99], [0.9], [NAN, 0.9], "0.9"])
def test_optimizer_betas_in_zero_one(kind, betas):
    refused(opt(kind, betas=betas), "optimizer.params.betas")


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta"])
@pytest.mark.parametrize("eps", [0, -1e-8, NAN])
def test_optimizer_eps_must_be_positive(kind, eps):
    refused(opt(kind, eps=eps), "optimizer.params.eps")


def test_torch_optimizer_params_that_work_today_still_load():
    cfg = load(opt("SGD", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4))
    assert cfg.optimizer.params == {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                    "weight_decay": 1e-4}
    assert load(opt("LBFGS", max_iter=20.0)).optimizer.params == {"max_iter": 20}
    load(opt("Adafactor", eps=[None, 1e-3], beta2_decay=-0.8))
    load(opt("Rprop", etas=[0.5, 1.2], step_sizes=[1e-6, 50]))
    refused(opt("SGD", nesterov=1), "optimizer.params.nesterov", "true or false")
    refused(opt("LBFGS", max_iter=2.5), "optimizer.params.max_iter", "integer")


def test_adagrad_keys_follow_the_implementation_offload_chooses():
    load(opt("Adagrad", lr_decay=0.1))  # torch.optim.Adagrad
    load(opt("Adagrad", stage=2, offload=True, fp32_optimizer_states=False))  # CPUAdagrad
    refused(opt("Adagrad", stage=2, offload=True, lr_decay=0.1), "optimizer.params.lr_decay",
            "CPUAdagrad")
    refused(opt("Adagrad", fp32_optimizer_states=False),
            "optimizer.params.fp32_optimizer_states", "torch.optim.Adagrad")


# -- huge integers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg, key", [
    ({"fp16": {"enabled": True, "initial_scale_power": 1e6}}, "fp16.initial_scale_power"),
    ({"fp16": {"enabled": True, "initial_scale_power": 1e30}}, "fp16.initial_scale_power"),
    ({"fp16": {"enabled": True, "initial_scale_power": 128}}, "fp16.initial_scale_power"),
    ({"gradient_accumulation_steps": 1e30}, "gradient_accumulation_steps"),
    ({"gradient_accumulation_steps": 10 ** 30}, "gradient_accumulation_steps"),
    ({"zero_optimization": {"stage": 3, "sub_group_size": 1e30}},
     "zero_optimization.sub_group_size"),
    ({"zero_optimization": {"stage": 3, "sub_group_size": 2 ** 62 + 1}},
     "zero_optimization.sub_group_size"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e19}},
     "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"stage": 3, "model_persistence_threshold": 2 ** 63}},
     "zero_optimization.model_persistence_threshold"),
    ({"fp16": {"enabled": True, "min_loss_scale": -1e30}}, "fp16.min_loss_scale"),
    ({"steps_per_print": 1e30}, "steps_per_print"),
])
def test_huge_integers_are_config_errors_naming_the_key(cfg, key):
    refused(cfg, key)


def test_the_bounds_keep_what_deepspeed_accepts():
    import sys
    cfg = load({"fp16": {"enabled": True, "initial_scale_power": 127},
                "zero_optimization": {"stage": 3, "sub_group_size": 1e12,
                                      "model_persistence_threshold": sys.maxsize}})
    from zero_ext.optim.loss_scaler import scaler_from_config
    assert math.isfinite(scaler_from_config(cfg.fp16).loss_scale)


def test_derived_train_batch_size_must_fit_int64():
    with pytest.raises(ConfigError) as info:
        load({"train_micro_batch_size_per_gpu": 2 ** 62, "gradient_accumulation_steps": 2})
    assert "train_micro_batch_size_per_gpu" in str(info.value)
    assert "gradient_accumulation_steps" in str(info.value)


# -- NVMe buffers, aio -----------------------------------------------------------------------------

def nvme(section, **keys):
    return {"zero_optimization": {"stage": 3, section: {"device": "nvme", "nvme_path": "/nvme",
                                                        **keys}}}


def test_nvme_needs_a_buffer():
    refused(nvme("offload_optimizer", buffer_count=0), "zero_optimization.offload_optimizer.buffer_count",
            ">= 1")
    refused(nvme("offload_param", buffer_count=0), "zero_optimization.offload_param.buffer_count",
            ">= 1")
    cpu = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                   "buffer_count": 0}}}
    load(cpu)  # the buffers are only NVMe's


@pytest.mark.parametrize("read, write, count, ok", [
    (True, True, 2, False), (True, True, 3, True), (True, False, 1, False), (True, False, 2, True),
    (False, True, 1, False), (False, False, 1, True)])
def test_pipelines_need_their_buffers_at_load(read, write, count, ok):
    cfg = nvme("offload_optimizer", buffer_count=count, pipeline_read=read, pipeline_write=write)
    if ok:
        load(cfg)
        return
    text = refused(cfg, "zero_optimization.offload_optimizer.buffer_count")
    for name, on in (("pipeline_read", read), ("pipeline_write", write)):
        assert (name in text) == on


@pytest.mark.parametrize("key, value", [("block_size", 1000), ("block_size", 2 ** 31),
                                        ("queue_depth", 8192), ("intra_op_parallelism", 65),
                                        ("thread_count", 0)])
def test_aio_values_outside_the_c_engine_are_refused(key, value):
    with pytest.raises(ConfigError) as info:
        load({"aio": {key: value}})
    assert key in str(info.value)


# -- docs tell the truth -------------------------------------------------------------------------

def test_initialize_implemented_list_matches_the_config_package():
    from zero_ext.initialize import IMPLEMENTED
    assert set(IMPLEMENTED) == set(IMPLEMENTED_BY_INITIALIZE) <= set(UNIMPLEMENTED)


def test_docs_do_not_call_fp16_unimplemented():
    from zero_ext.config.docgen import render
    text = render()
    row = next(line for line in text.splitlines() if line.startswith("| `enabled` | `false` |")
               and "fp16" in line)
    assert "Not implemented" not in row
    not_done = text.split("## Not implemented yet")[1].split("These entries")[0]
    for path in IMPLEMENTED_BY_INITIALIZE:
        assert f"| `{path}` |" not in not_done
