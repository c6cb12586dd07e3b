"""A rank that does something else than the others ends every rank with a named error, in seconds, on
the native transport and on torch.distributed (ZERO_EXT_COMM=torch): GatheredParameters entered by one
rank or with different modifier_rank, a module skipped on one rank whose parameters need no gather
(ZeRO-3 persistent ones; any at stage 2), ranks at different step numbers, a rank that raises in forward,
a rank that runs one more step. Each rank catches its error and returns it with the seconds it took
(optim/step_check.py, zero/gathered.py)."""
import time

import pytest
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.zero3 import rank

TRANSPORTS = {"native": {}, "torch": {"ZERO_EXT_COMM": "torch"}}
BOUND_S = 20  # generous (2 loaded cores): each case fails in well under a second when the machine is quiet


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.small = nn.Linear(8, 8)  # 72 elements: persistent under the default threshold at stage 3
        self.head = nn.Linear(8, 4)

    def forward(self, x, skip=False):
        h = torch.tanh(self.stem(x))
        if not skip:
            h = torch.tanh(self.small(h))
        return self.head(h)


def _engine(stage, **zero):
    import zero_ext

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, **zero}}
    return zero_ext.initialize(model=Branchy(), config=config)[0]


def _train(engine, steps, skip_at=None):
    for step in range(steps):
        out = engine(torch.ones(2, 8), skip=step == skip_at)
        engine.backward(out.sum())
        engine.step()


def _timed(fn, *args):
    """(error type and message, or "ok"; seconds from the start of the faulty part to the error)."""
    start = time.monotonic()
    try:
        fn(*args)
        return "ok", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - every rank's outcome goes back to the test
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


def _check(results, *expected):
    for r, (message, seconds) in enumerate(results):
        assert seconds < BOUND_S, f"rank {r} took {seconds:.1f}s: {message}"
        for text in expected:
            assert text in message, f"rank {r}: {message}"


# -- GatheredParameters -----------------------------------------------------------------------------------

def _gathered(case, threshold):
    import zero_ext.zero as zero

    engine = _engine(3, stage3_param_persistence_threshold=threshold)
    _train(engine, 1)
    weight = engine.module.stem.weight

    def faulty():
        if case == "rank 0 only":
            if rank() == 0:
                with zero.GatheredParameters(weight):
                    pass
        else:
            modifier = {"0 and 1": rank(), "0 and None": 0 if rank() == 0 else None}[case]
            with zero.GatheredParameters(weight, modifier_rank=modifier):
                pass
        _train(engine, 1)
    return _timed(faulty)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("case,threshold", [("rank 0 only", 0), ("rank 0 only", 10**6), ("0 and 1", 0),
                                            ("0 and None", 10**6)],
                         ids=["one-rank", "one-rank-persistent", "modifier-0-1", "modifier-0-None"])
def test_gathered_parameters_entered_differently_is_named_on_every_rank(case, threshold, transport):
    results = run_ranks(2, _gathered, case, threshold, timeout=60, env=TRANSPORTS[transport])
    _check(results, "FetchOrderError")
    for message, _ in results:
        if case == "rank 0 only":
            assert "rank 0: GatheredParameters(modifier_rank=None): 1 parameter(s), 64 elements" in message
        else:
            assert "rank 0: GatheredParameters(modifier_rank=0)" in message
            assert f"rank 1: GatheredParameters(modifier_rank={1 if case == '0 and 1' else None})" in message


# -- a module skipped on one rank -----------------------------------------------------------------------

def _skip(stage):
    engine = _engine(stage)  # stage 3: every parameter of Branchy is persistent (no gather, no fetch check)
    _train(engine, 1)
    return _timed(_train, engine, 1, 0 if rank() == 1 else None)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("stage", [2, 3])
def test_a_module_skipped_on_one_rank_is_named_on_every_rank(stage, transport):
    # before: silently wrong gradients on the native transport, a rank killed by SIGABRT on gloo
    results = run_ranks(2, _skip, stage, timeout=60, env=TRANSPORTS[transport])
    _check(results, "FetchOrderError", "the ranks are at different points of the training step",
           "rank 0: gradient reduction of", "rank 1: gradient reduction of", "6 parameter(s), 180 elements",
           "4 parameter(s), 108 elements")


# -- step numbers, a rank that raises, a rank with one more step ----------------------------------------------

def _step_numbers():
    engine = _engine(1)
    _train(engine, 1)
    if rank() == 1:  # e.g. ranks that resumed from different checkpoints
        engine.restore_counters({"global_steps": 5})
    return _timed(_train, engine, 1)


def test_ranks_at_different_step_numbers_are_named():
    _check(run_ranks(2, _step_numbers, timeout=60), "FetchOrderError",
           "rank 0: engine.step() at the accumulation boundary of step 1",
           "rank 1: engine.step() at the accumulation boundary of step 5")


def _raises_in_forward(stage):
    engine = _engine(stage)
    _train(engine, 1)

    def faulty():
        if rank() == 1:
            raise ValueError("a bad batch on rank 1")
        _train(engine, 1)
    return _timed(faulty)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_that_raises_in_forward_ends_the_others(stage, transport):
    results = run_ranks(2, _raises_in_forward, stage, timeout=60, env=TRANSPORTS[transport])
    _check(results[1:], "ValueError: a bad batch on rank 1")
    # the survivor: named by the native transport (rank 1's seat), on torch.distributed by what rank 1 left in
    # the store as its group ended (comm/departures.py), gloo's own text after it
    if transport == "native":
        _check(results[:1], "CommError", "rank 1 left before arriving")
    else:
        _check(results[:1], "CommError", "rank 1 left: it ended its process group", "torch.distributed said")


def _one_more_step(stage, then):
    engine = _engine(stage)
    _train(engine, 2)

    def faulty():
        if rank() == 1:
            _train(engine, 1)
        if then == "save":
            engine.save_checkpoint(f"/tmp/zero_ext-one-more-step-{id(engine)}")
    return _timed(faulty)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_rank_with_one_more_step_ends_every_rank_before_a_checkpoint(stage):
    # rank 0 enters save_checkpoint's agreement, rank 1 the extra step's first collective: on the native
    # transport they meet in the same round, whose stamps differ, and both fail at once naming both (not
    # after ZERO_EXT_COLLECTIVE_CHECK_TIMEOUT, 120 s)
    results = run_ranks(2, _one_more_step, stage, "save", timeout=60)
    _check(results, "ranks in different collectives", "in save_checkpoint #")
    _check(results[:1], "CheckpointError: save_checkpoint is collective, but not every rank is calling it now")
