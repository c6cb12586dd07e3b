"""The engine's step lifecycle (engine.phase, a StepPhase): the transition table, and every lifecycle misuse
error raised from it, in one engine's life (stages 0-3, one and two ranks)."""
import warnings

import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP


def test_the_table_names_a_phase_for_every_allowed_event_and_nothing_leaves_destroyed():
    from zero_ext.engine import TRANSITIONS, StepPhase

    assert set(TRANSITIONS) == {"backward", "micro_step", "boundary_step", "read_gradients", "reduce_early",
                                "zero_grad", "destroy"}
    for event, moves in TRANSITIONS.items():
        assert all(isinstance(a, StepPhase) and isinstance(b, StepPhase) for a, b in moves.items()), event
        assert StepPhase.DESTROYED not in moves or event == "destroy", event
        assert StepPhase.FORWARD_ONLY not in moves or event in ("zero_grad", "destroy"), event
    assert all(TRANSITIONS["destroy"][p] is StepPhase.DESTROYED for p in StepPhase)
    # gradients exist, and can be read, only between a backward and the step that applies them
    assert set(TRANSITIONS["read_gradients"]) == {StepPhase.BACKWARD, StepPhase.ACCUMULATED, StepPhase.REDUCED}
    assert set(TRANSITIONS["boundary_step"]) == {StepPhase.BACKWARD, StepPhase.REDUCED}


def _engine(stage, gas=2, optimizer=True):
    import zero_ext

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
              "zero_optimization": {"stage": stage}}
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    return zero_ext.initialize(model=MLP(), config=config)[0]


def _attempt(log, label, engine, call):
    """Runs call; logs (label, the phase after, the error or None)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        error = "warning: " + str(caught[0].message) if caught else None
    except RuntimeError as exc:
        error = str(exc)
    log.append((label, engine.phase.name, error))


def _life(stage, save_dir):
    from zero_ext import utils

    engine = _engine(stage)
    gen = torch.Generator().manual_seed(1)
    p = engine.module.head.weight
    log = [("fresh", engine.phase.name, None)]
    loss = lambda: engine.module.loss(MLP.batch(2, gen))  # noqa: E731
    _attempt(log, "step without backward", engine, lambda: engine.step())
    _attempt(log, "read in idle", engine, lambda: utils.safe_get_full_grad(p))
    _attempt(log, "backward", engine, lambda: engine.backward(loss()))
    _attempt(log, "read before the boundary", engine, lambda: utils.safe_get_full_grad(p))
    _attempt(log, "micro step", engine, lambda: engine.step())
    _attempt(log, "backward at the boundary", engine, lambda: engine.backward(loss()))
    _attempt(log, "read at the boundary", engine, lambda: utils.safe_get_full_grad(p))
    _attempt(log, "backward after the read", engine, lambda: engine.backward(loss()))
    _attempt(log, "boundary step", engine, lambda: engine.step())
    _attempt(log, "read after the step", engine, lambda: utils.safe_get_full_grad(p))

    def outside():
        loss().backward()
        engine.step()
    _attempt(log, "loss.backward() then step", engine, outside)
    _attempt(log, "zero_grad", engine, lambda: engine.zero_grad())
    _attempt(log, "backward again", engine, lambda: engine.backward(loss()))
    _attempt(log, "zero_grad after backward", engine, lambda: engine.zero_grad())
    engine.backward(loss())
    _attempt(log, "second backward in one micro step", engine, lambda: engine.backward(loss()))
    engine.zero_grad()

    def step_in_no_sync():
        with engine.no_sync():
            engine.backward(loss())
            engine.step()
    _attempt(log, "step inside no_sync", engine, step_in_no_sync)
    engine.zero_grad()
    engine.offload_states()
    _attempt(log, "forward while offloaded", engine, lambda: engine(MLP.batch(2, gen)[0]))
    _attempt(log, "backward while offloaded", engine, lambda: engine.backward(torch.ones((), requires_grad=True) * 2))
    _attempt(log, "step while offloaded", engine, lambda: engine.step())
    engine.reload_states()
    late = loss()  # (after destroy, a stage-3 model's forward has no gathered weights)
    _attempt(log, "destroy", engine, lambda: engine.destroy())
    _attempt(log, "backward after destroy", engine, lambda: engine.backward(late))
    _attempt(log, "step after destroy", engine, lambda: engine.step())
    _attempt(log, "forward after destroy", engine, lambda: engine(MLP.batch(2, gen)[0]))
    _attempt(log, "save_checkpoint after destroy", engine, lambda: engine.save_checkpoint(save_dir))
    forward_only = _engine(stage, optimizer=False)
    log.append(("forward-only", forward_only.phase.name, None))
    _attempt(log, "forward-only backward", forward_only, lambda: forward_only.backward(forward_only.module.loss(
        MLP.batch(2, gen))))
    _attempt(log, "forward-only step", forward_only, lambda: forward_only.step())
    forward_only.destroy()
    return log


GRADS_NONE = "there are no gradients now"
BOUNDARY = "only at the gradient-accumulation boundary"
AVERAGED = "were already averaged across ranks"
TWICE = "warning: engine.backward() was called again before engine.step()"


@pytest.mark.parametrize("stage,world", [(0, 1), (1, 2), (2, 2), (3, 1)])
def test_every_misuse_is_an_error_of_the_phase_it_happens_in(stage, world, tmp_path):
    early = stage < 2  # stages 0/1 average gradients only at the boundary, so a read there is final
    expect = [
        ("fresh", "IDLE", None),
        ("step without backward", "IDLE", "warning: engine.step() was called before engine.backward()"),
        ("read in idle", "IDLE", GRADS_NONE),
        ("backward", "BACKWARD", None),
        ("read before the boundary", "BACKWARD", BOUNDARY if early else None),
        ("micro step", "ACCUMULATED", None),
        ("backward at the boundary", "BACKWARD", None),
        ("read at the boundary", "REDUCED" if early else "BACKWARD", None),
        ("backward after the read", "REDUCED" if early else "BACKWARD", AVERAGED if early else None),
        ("boundary step", "IDLE", None),
        ("read after the step", "IDLE", GRADS_NONE),
        ("loss.backward() then step", "IDLE", "engine.backward() was not called since the last step"),
        ("zero_grad", "IDLE", None),
        ("backward again", "BACKWARD", None),
        ("zero_grad after backward", "IDLE", None),
        ("second backward in one micro step", "BACKWARD", None),  # (accumulating: several are the plan)
        ("step inside no_sync", "BACKWARD",
         "Engine.step() inside no_sync context manager (here engine.no_sync())" if early
         else "no_sync context manager is incompatible with ZeRO stage"),
        ("forward while offloaded", "IDLE", "engine.forward: lp_params"),
        ("backward while offloaded", "IDLE", "engine.backward: "),
        ("step while offloaded", "IDLE", "engine.step: "),
        ("destroy", "DESTROYED", None),
        ("backward after destroy", "DESTROYED", "engine.backward: this engine was destroyed"),
        ("step after destroy", "DESTROYED", "engine.step: this engine was destroyed"),
        ("forward after destroy", "DESTROYED",
         "engine.forward: this engine was destroyed (engine.destroy())" + (
             "; its ZeRO-3 parameters stay partitioned" if stage == 3 else "")),
        ("save_checkpoint after destroy", "DESTROYED", "engine.save_checkpoint: this engine was destroyed"),
        ("forward-only", "FORWARD_ONLY", None),
        ("forward-only backward", "FORWARD_ONLY", "engine.backward: this engine has no optimizer"),
        ("forward-only step", "FORWARD_ONLY", "engine.step: this engine has no optimizer"),
    ]
    if not early:  # no_sync refuses at once: no backward ran inside it
        i = [e[0] for e in expect].index("step inside no_sync")
        expect[i] = ("step inside no_sync", "IDLE", expect[i][2])
    for log in run_ranks(world, _life, stage, str(tmp_path)):
        assert [(label, phase) for label, phase, _ in log] == [(label, phase) for label, phase, _ in expect]
        for (label, _, error), (_, _, want) in zip(log, expect):
            if want is None:
                assert error is None, (label, error)
            else:
                assert error is not None and want in error, (label, error)


def _two_backwards(stage):
    engine = _engine(stage, gas=1)
    gen = torch.Generator().manual_seed(1)
    log = []
    for label in ("first", "second", "third"):
        _attempt(log, label, engine, lambda: engine.backward(engine.module.loss(MLP.batch(2, gen))))
    engine.step()
    engine.set_gradient_accumulation_boundary(True)  # a caller that counts micro steps itself (accelerate)
    engine.backward(engine.module.loss(MLP.batch(2, gen)))
    _attempt(log, "caller's boundary", engine, lambda: engine.backward(engine.module.loss(MLP.batch(2, gen))))
    engine.destroy()
    return log


@pytest.mark.parametrize("stage", [1, 3])
def test_two_backward_passes_before_a_step_at_accumulation_1_warn_once(stage):
    log = run_ranks(1, _two_backwards, stage)[0]
    assert [(label, error is not None and TWICE in error) for label, _, error in log] == [
        ("first", False), ("second", True), ("third", False), ("caller's boundary", False)]
