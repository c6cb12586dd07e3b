"""managed_gradient_accumulation: false (DeepSpeed's key): the caller's every step() is the accumulation
boundary. N backward passes then one step equal the managed engine with gradient_accumulation_steps N;
global_samples counts the micro batches that ran; the boundary cannot be set, coalescing is refused and
overlap_comm below stage 2 is a config error."""
import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP

GAS = 3


def _config(stage, managed):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS,
            "managed_gradient_accumulation": managed, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage}}


def _train(stage, managed, counts):
    """``counts``: backward passes before each step() (managed: one, GAS times per update)."""
    import zero_ext

    torch.manual_seed(0)
    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(stage, managed))
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    applied = []
    for n in counts:
        for _ in range(n):
            engine.backward(engine(MLP.batch(2, gen)[0]).pow(2).mean())
        engine.step()
        applied.append(engine.was_step_applied())
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        params = {k: p.detach().clone() for k, p in engine.module.named_parameters()}
    out = params, applied, engine.global_steps, engine.global_samples
    engine.destroy()
    return out


def _compare(stage):
    ref, ref_applied, ref_steps, _ = _train(stage, True, [1] * (2 * GAS))
    got, applied, steps, samples = _train(stage, False, [GAS, GAS])
    diff = max((ref[k] - got[k]).abs().max().item() for k in ref)
    _, _, steps_varied, samples_varied = _train(stage, False, [1, 2, 4])
    return diff, ref_applied, applied, ref_steps, steps, samples, steps_varied, samples_varied


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unmanaged_steps_match_managed_accumulation(stage):
    for diff, ref_applied, applied, ref_steps, steps, samples, steps_varied, samples_varied in run_ranks(
            2, _compare, stage):
        assert diff < 1e-6
        assert ref_applied == [False, False, True] * 2 and applied == [True, True]
        assert ref_steps == steps == 2 and samples == 2 * GAS * 2 * 2  # micro batch 2, 2 ranks
        assert steps_varied == 3 and samples_varied == (1 + 2 + 4) * 2 * 2


def _refusals(stage):
    import zero_ext

    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(stage, False))
    errors = []
    for call in (lambda: engine.set_gradient_accumulation_boundary(True),
                 lambda: engine.coalesce_grad_reduction().__enter__()):
        try:
            call()
        except AssertionError as exc:
            errors.append(str(exc))
    engine.destroy()
    return errors


def test_unmanaged_refuses_boundary_setting_and_coalescing():
    errors = run_ranks(1, _refusals, 2)[0]
    assert "set_gradient_accumulation_boundary" in errors[0] and "coalesce_grad_reduction" in errors[1]


def test_unmanaged_overlap_comm_below_stage_2_is_a_config_error():
    from zero_ext.config import ConfigError, load_config

    for stage in (0, 1):
        cfg = {**_config(stage, False), "zero_optimization": {"stage": stage, "overlap_comm": True}}
        with pytest.raises(ConfigError, match="overlap_comm only with ZeRO stage 2"):
            load_config(cfg)
    load_config({**_config(2, False), "zero_optimization": {"stage": 2, "overlap_comm": True}})
