"""Stage 0 over an fp32 model hands out the base optimizer itself, as DeepSpeed does (optim/handed_out.py):
the client's object, the callable's result or the config section's optimizer; a torch scheduler built over
it after initialize drives the engine's steps; its zero_grad drops the engine's gradients wherever in the
step cycle it is called; stepped directly by the script, it steps the gradients averaged across ranks;
every other stage and precision keeps the ZeroOptimizer. 2 gloo ranks against one
plain process that sees both ranks' batches."""
import warnings

import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP


def _batches(world, n):
    gen = torch.Generator().manual_seed(5)
    return [MLP.batch(2 * world, gen) for _ in range(n)]


def _train(how):
    """Four iterations, ``optimizer.zero_grad()`` where a DeepSpeed-style script calls it; the scheduler
    halves the learning rate every step. Returns the largest gap to the plain reference, the learning
    rates seen, and what initialize handed out."""
    import zero_ext

    torch.manual_seed(0)
    model, ref = MLP(), MLP()
    ref.load_state_dict(model.state_dict())
    client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: a dropped step would show
    engine, opt, _, _ = zero_ext.initialize(model=model, optimizer=client, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda k: 0.5 ** k)
    world, rank = engine.world_size, engine.global_rank
    lrs = []
    for it, (x, y) in enumerate(_batches(world, 4)):
        mine = (x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        if how == "before":  # the common loop: zero_grad, forward, backward, step
            opt.zero_grad()
            ref_opt.zero_grad()
        engine.backward(model.loss(mine))
        ref.loss((x, y)).backward()
        if how == "between" and it == 2:  # this step's gradients dropped: the step applies nothing
            opt.zero_grad()
            ref_opt.zero_grad()
        if how == "direct":  # DeepSpeed-style: the base stepped and cleared by the script itself
            opt.step()
            opt.zero_grad()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # (the engine's note of a step without gradients)
                engine.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        if how in ("between", "direct"):
            ref_opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
    gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    handed = (opt is client, opt is engine.optimizer, type(engine.zero_optimizer).__name__)
    engine.destroy()
    return gap, lrs, handed, "zero_grad" in client.__dict__


@pytest.mark.parametrize("how", ["before", "between", "direct"])
def test_the_client_optimizer_is_handed_out_and_trains_like_torch(how):
    for gap, lrs, handed, still_patched in run_ranks(2, _train, how):
        assert handed == (True, True, "ZeroOptimizer")
        assert lrs == [0.05, 0.025, 0.0125, 0.00625]
        assert gap < 1e-6, gap
        assert not still_patched  # destroy gave the base its own zero_grad back


def _handed_out(cases):
    import zero_ext

    out = []
    for stage, precision, source in cases:
        torch.manual_seed(0)
        model = MLP()
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
        if precision:
            config[precision] = {"enabled": True}
        optimizer = None
        if source == "config":
            config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
        elif source == "callable":
            optimizer = lambda groups: torch.optim.AdamW(groups, lr=1e-2)  # noqa: E731
        engine, opt, _, _ = zero_ext.initialize(model=model, config=config, optimizer=optimizer)
        out.append((isinstance(opt, torch.optim.Optimizer), opt is engine.zero_optimizer.optimizer,
                    opt is engine.basic_optimizer))
        engine.destroy()
    return out


def test_only_stage_0_over_fp32_hands_out_the_base():
    cases = [(0, None, "config"), (0, None, "callable"), (0, "bf16", "config"), (0, "fp16", "callable"),
             (1, None, "config"), (2, None, "callable"), (3, None, "config")]
    found = run_ranks(1, _handed_out, cases)[0]
    base = (True, True, True)
    wrapped = (False, False, False)
    assert found == [base, base, wrapped, wrapped, wrapped, wrapped, wrapped]
