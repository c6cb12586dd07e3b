"""bf16/fp16 cast a model's parameters, not its buffers (DeepSpeed 0.19.5+): an fp32 buffer such as a rotary
``inv_freq`` stays fp32 at every stage unless ``data_types.buffer_dtype`` names a dtype; zero.Init still
builds buffers in its dtype; ``data_types.param_dtype`` must agree with the precision mode. 2 gloo ranks."""
import pytest
import torch

from helpers.harness import run_ranks


class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)))
        self.register_buffer("steps", torch.arange(3))  # an integer buffer is never cast
        self.register_buffer("ones", torch.ones(4))  # made by a factory: zero.Init makes it in its dtype

    def forward(self, x):
        angle = self.inv_freq.repeat(2) * 3.0
        return self.proj(x) * torch.cos(angle).to(x.dtype) * self.ones.to(x.dtype)


def _config(stage, **data_types):
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    if data_types:
        cfg["data_types"] = data_types
    return cfg


def _dtypes(stage, under_init, data_types):
    import zero_ext

    cfg = _config(stage, **data_types)
    if under_init:
        with zero_ext.zero.Init(config_dict_or_path=cfg):
            model = Rotary()
    else:
        model = Rotary()
    engine = zero_ext.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    engine.backward(engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum())
    engine.step()
    m = engine.module
    out = (m.proj.weight.dtype, m.inv_freq.dtype, m.steps.dtype, m.ones.dtype)
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_casts_parameters_and_keeps_fp32_buffers(stage):
    for got in run_ranks(2, _dtypes, stage, False, {}):
        assert got == (torch.bfloat16, torch.float32, torch.int64, torch.float32)


@pytest.mark.parametrize("stage,spelling", [(1, "bf16"), (3, "bfloat16")])
def test_buffer_dtype_casts_floating_buffers(stage, spelling):
    for got in run_ranks(2, _dtypes, stage, False, {"buffer_dtype": spelling, "param_dtype": "bf16"}):
        assert got == (torch.bfloat16, torch.bfloat16, torch.int64, torch.bfloat16)


def test_zero_init_makes_factory_buffers_in_its_dtype_and_initialize_keeps_them():
    for got in run_ranks(2, _dtypes, 3, True, {}):  # inv_freq is computed (.float() of arange): fp32 as built
        assert got == (torch.bfloat16, torch.float32, torch.int64, torch.bfloat16)


def test_param_dtype_must_match_the_precision_mode():
    from zero_ext.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data_types.param_dtype.*conflicts with the training precision the "
                                          r"config enables \(bf16\)"):
        load_config(_config(2, param_dtype="fp16"))
    assert load_config(_config(2, param_dtype="bfloat16")).data_types.param_dtype == "bf16"
