"""The engine calls Hugging Face's Trainer and accelerate make, on their own (2 gloo ranks):
set_gradient_accumulation_boundary + backward(scale_wrt_gas=False), retain_graph, a plain
loss.backward() refused at the step, several engines in one process (policy + reference), the config and
16-bit queries, and save_16bit_model to a safetensors file."""
import os

import pytest
import torch

from helpers.harness import RankFailed, run_ranks
from helpers.models import MLP


def _config(stage, gas=2, optimizer=True, **zero):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": stage, **zero}}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    return cfg


def _engine(stage, **kw):
    import zero_ext

    torch.manual_seed(0)
    return zero_ext.initialize(model=MLP(), config=_config(stage, **kw))[0]


def _full_params(engine):
    from zero_ext.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _caller_sets_the_boundary(stage):
    """accelerate's DeepSpeedEngineWrapper: the loss already divided by the accumulation steps,
    backward(scale_wrt_gas=False), the boundary set by the caller, step() only at the boundary; against
    the engine's own accounting (backward(loss), step() every micro step). Two engines in one process."""
    caller, own = _engine(stage), _engine(stage)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    applied = []
    for step in range(2):
        for micro in range(2):
            batch = MLP.batch(2, gen)
            boundary = micro == 1
            caller.set_gradient_accumulation_boundary(is_boundary=boundary)
            caller.backward(caller.module.loss(batch) / 2, scale_wrt_gas=False)
            if boundary:
                caller.step()
                applied.append(caller.was_step_applied())
            own.backward(own.module.loss(batch))
            own.step()
    diff = max((a - b).abs().max().item() for a, b in zip(_full_params(caller), _full_params(own)))
    steps = (caller.global_steps, own.global_steps)
    caller.destroy()
    own.destroy()
    return diff, applied, steps


@pytest.mark.parametrize("stage", [2, 3])
def test_caller_set_boundary_and_unscaled_backward_match_the_engines_own_accounting(stage):
    for diff, applied, steps in run_ranks(2, _caller_sets_the_boundary, stage):
        assert diff < 1e-6 and applied == [True, True] and steps == (2, 2)


def _retain_graph(stage):
    engine = _engine(stage, gas=1)
    loss = engine.module.loss(MLP.batch(2, torch.Generator().manual_seed(0)))
    engine.backward(loss, retain_graph=True)
    engine.backward(loss)  # the same graph a second time
    engine.step()
    applied = engine.was_step_applied()
    engine.destroy()
    return applied


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backward_with_retain_graph_keeps_the_graph(stage):
    assert run_ranks(2, _retain_graph, stage) == [True, True]


def _plain_backward(stage):
    engine = _engine(stage, gas=1)
    engine.module.loss(MLP.batch(2, torch.Generator().manual_seed(0))).backward()  # not engine.backward
    engine.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_plain_loss_backward_is_refused_at_the_step(stage):
    with pytest.raises(RankFailed, match=r"call engine.backward\(loss\) instead of loss.backward\(\)"):
        run_ranks(2, _plain_backward, stage)


def _policy_and_reference():
    """A trained policy and a frozen reference (no optimizer), both ZeRO-3, in one process: the policy
    learns towards the reference's outputs, the reference stays as it was."""
    import zero_ext

    torch.manual_seed(0)
    policy = zero_ext.initialize(model=MLP(), config=_config(3, gas=1))[0]
    torch.manual_seed(1)
    reference = zero_ext.initialize(model=MLP(), config=_config(3, gas=1, optimizer=False))[0]
    before = _full_params(reference)
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(4):
        x, _ = MLP.batch(2, gen)
        with torch.no_grad():
            target = reference(x)
        loss = (policy(x) - target).pow(2).mean()
        policy.backward(loss)
        policy.step()
        losses.append(loss.item())
    same = all(torch.equal(a, b) for a, b in zip(before, _full_params(reference)))
    policy.destroy()
    reference.destroy()
    return losses, same


def test_policy_and_reference_engines_in_one_process():
    for losses, reference_unchanged in run_ranks(2, _policy_and_reference):
        assert reference_unchanged and losses[-1] < losses[0]


def _queries(stage, gather):
    engine = _engine(stage, stage3_gather_16bit_weights_on_model_save=gather) if stage == 3 else _engine(stage)
    out = (engine.config.get("zero_optimization", {}).get("stage"), engine.config.get("train_batch_size"),
           engine.config.get("absent", "default"), engine.zero_optimization_partition_weights(),
           engine.zero_gather_16bit_weights_on_model_save())
    engine.destroy()
    return out


def test_config_get_and_16bit_queries_as_transformers_and_accelerate_ask():
    # Trainer reads engine.config.get("zero_optimization", {}).get("stage"); accelerate asks whether a
    # ZeRO-3 model's 16-bit weights can be gathered for saving
    assert run_ranks(2, _queries, 2, False)[0] == (2, 8, "default", False, False)
    assert run_ranks(2, _queries, 3, True)[0] == (3, 8, "default", True, True)


def _save_16bit(tmp, gather):
    engine = _engine(3, stage3_gather_16bit_weights_on_model_save=gather)
    saved = engine.save_16bit_model(tmp, "model.safetensors")
    full = dict(zip([n for n, _ in engine.module.named_parameters()], _full_params(engine)))
    engine.destroy()
    return saved, full


def test_save_16bit_model_writes_the_gathered_weights_as_safetensors(tmp_path):
    from safetensors.torch import load_file

    (saved, full), (saved1, _) = run_ranks(2, _save_16bit, str(tmp_path), True)
    assert saved and saved1
    on_disk = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(full) <= set(on_disk)
    assert all(torch.equal(on_disk[n], v) for n, v in full.items())
    saved, _ = run_ranks(2, _save_16bit, str(tmp_path / "no"), False)[0]
    assert not saved and not os.path.exists(tmp_path / "no")


def _step_twice(stage):
    """A second step() in a micro step, amid accumulation: a warning, not the outside-backward error."""
    import warnings

    engine = _engine(stage)  # accumulation over 2 micro steps
    engine.backward(engine.module.loss(MLP.batch(2, torch.Generator().manual_seed(0))))
    engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.step()
    engine.destroy()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_second_step_amid_accumulation_only_warns(stage):
    for messages in run_ranks(2, _step_twice, stage):
        assert len(messages) == 1 and "before engine.backward()" in messages[0]
