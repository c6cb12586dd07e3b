"""Resident decoding (zero_ext/zero/resident.py, [Note: resident decoding]) on 2 gloo ranks.

- HF ``generate`` partitioned with ``synced_gpus=True``, each rank its own prompt, prompt length and
  number of new tokens: the tokens of the unpartitioned model; once resident, no parameter gather and
  only the scheduled checks (1st, 2nd, 4th, ... forward) as fetch-order agreements;
- a rank-dependent branch inside HF ``generate`` (an extra module call on one rank from one token on)
  raises FetchOrderError on every rank at the next scheduled check, naming the module, well within the
  test's time bound (no hang: the ranks' other collective, generate's per-token all-reduce, never meets
  one of ours);
- the schedule exactly: a branch every rank takes is no error; a rank-dependent one is raised at the
  first check after it, having computed exactly meanwhile; the next forwards record again and match;
  ``check_fetch_order=False`` runs no check; a forward with autograd checks what the last check did
  not see before training goes on; a module skipped on one rank is named as a forward ended early;
  a backward of a graph from before the decoding gets the plain gradients and ends residency;
- a model over ``max_live_parameters`` is not made resident (it streams: tests/test_zero_streaming.py).
"""
import importlib.util
import time

import pytest
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.zero3 import generate_greedy, rank, tiny_llama

HAS_HF = importlib.util.find_spec("transformers") is not None
TIMEOUT = 240


def _engine(model):
    import zero_ext

    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    return zero_ext.initialize(model=model, config=cfg)[0]


def _prompt(length: int, seed: int):
    return torch.randint(1, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def _hf_resident_case():
    from zero_ext.zero import fetch
    from zero_ext.zero.resident import check_due

    r = rank()
    plain = tiny_llama()
    engine = _engine(tiny_llama())
    model, zm = engine.module, engine.zero_model
    # the first generate records the trace and makes the model resident (different lengths per rank)
    p1, n1 = _prompt(3 + 4 * r, 7 + r), 4 + 3 * r
    first = (generate_greedy(model, p1, n1), generate_greedy(plain, p1, n1))
    # the second runs resident from its first forward: count what it runs
    p2, n2 = _prompt(5 + 2 * r, 11 + r), 20 + 6 * r
    before = (fetch.agreements(), zm.meter.gathers, zm.coordinator.stats.resident_forwards)
    got = generate_greedy(model, p2, n2)
    after = (fetch.agreements(), zm.meter.gathers, zm.coordinator.stats.resident_forwards)
    expected = generate_greedy(plain, p2, n2)
    forwards = after[2] - before[2]
    scheduled = sum(check_due(n) for n in range(before[2] + 1, after[2] + 1))
    engine.destroy()
    return first, got == expected, after[0] - before[0], after[1] - before[1], forwards, scheduled


@pytest.mark.skipif(not HAS_HF, reason="needs transformers")
def test_hf_generate_resident_gathers_nothing_and_checks_on_the_schedule_only():
    for first, same, agreements, gathers, forwards, scheduled in run_ranks(2, _hf_resident_case, timeout=TIMEOUT):
        assert first[0] == first[1] and same
        assert forwards == 26  # synced_gpus: both ranks run the longest rank's 26 forwards
        assert gathers == 0 and agreements == scheduled, (gathers, agreements, scheduled)
        assert agreements / forwards <= 0.25, agreements  # (here after resident forwards 8 and 16)


def _hf_branch_case():
    from zero_ext.zero import FetchOrderError

    engine = _engine(tiny_llama())
    model = engine.module
    calls = []

    def extra_call_on_rank_1(module, args):  # from the 5th forward on, rank 1 runs one more module
        calls.append(1)
        if rank() == 1 and len(calls) >= 5:
            model.model.layers[0].mlp(args[0])
    model.model.norm.register_forward_pre_hook(extra_call_on_rank_1)
    start = time.monotonic()
    try:
        generate_greedy(model, _prompt(4 + rank(), 3 + rank()), 12)
        message = None
    except FetchOrderError as exc:
        message = str(exc)
    took = time.monotonic() - start
    engine.destroy()
    return message, len(calls), took


@pytest.mark.skipif(not HAS_HF, reason="needs transformers")
def test_a_rank_dependent_branch_in_hf_generate_is_a_named_error_on_every_rank():
    for message, forwards, took in run_ranks(2, _hf_branch_case, timeout=TIMEOUT):
        # forward 1 records, forward 2 makes the model resident; forward 5 is resident forward 3, and the
        # check after resident forward 4 (forward 6) finds it, on both ranks
        assert message is not None and forwards == 6, (forwards, message)
        assert "rank 0: checking after 4 resident forward(s), all along the recorded trace" in message, message
        assert "rank 1: checking after 4 resident forward(s); forward 3 left the trace" in message, message
        assert "model.layers.0.mlp" in message, message
        assert took < TIMEOUT / 2, took  # named error, not a hang (generous: the machine is shared)


# -- the schedule, on a small model ---------------------------------------------------------------------

class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.every_rank, self.on_rank_1, self.skip_on_rank_1 = False, False, False

    def forward(self, x):
        x = torch.tanh(self.a(x))
        if self.every_rank or (self.on_rank_1 and rank() == 1):
            x = self.c(x)
        if self.skip_on_rank_1 and rank() == 1:
            return x
        return self.b(x)


def _schedule_case(check: bool):
    from zero_ext.zero import FetchOrderError, ZeroModel, fetch

    torch.manual_seed(0)
    model, plain = _Branchy(), _Branchy()
    plain.load_state_dict(model.state_dict())
    zm = ZeroModel(model, param_persistence_threshold=0, check_fetch_order=check)
    x = torch.randn(2, 8)
    same, raised, agreements = [], [], []
    with torch.no_grad():
        for f in range(1, 23):
            # resident forwards are f - 2; checks after resident 1, 2, 4, 8, 16 (forwards 3, 4, 6, 10, 18)
            both = 7 <= f <= 9  # every rank takes the branch: no error at forward 10's check
            one = 13 <= f <= 18  # rank 1 alone from resident forward 11: raised at forward 18's check
            model.every_rank = plain.every_rank = both
            model.on_rank_1 = plain.on_rank_1 = one
            before = fetch.agreements()
            try:
                same.append(torch.equal(model(x), plain(x)))
            except FetchOrderError as exc:
                raised.append((f, str(exc)))
            agreements.append(fetch.agreements() - before)
    resident = zm.coordinator.stats.resident_forwards
    zm.destroy()
    return same, raised, agreements, resident


def test_the_resident_schedule_raises_a_rank_dependent_branch_at_the_next_check():
    for same, raised, agreements, resident in run_ranks(2, _schedule_case, True, timeout=60):
        assert all(same), same  # every forward computed exactly, the branched ones too
        assert len(raised) == 1 and raised[0][0] == 18, raised
        message = raised[0][1]
        assert "rank 0: checking after 16 resident forward(s), all along the recorded trace" in message, message
        assert ("rank 1: checking after 16 resident forward(s); forward 11 left the trace at fetch 1: the "
                "forward of module 'c' (Linear), where the trace has the forward of module 'b' (Linear)") in message
        # one agreement at each scheduled check (forward 2's carries the residency decision); forwards 19-22
        # record again and follow the new trace, checked every forward until resident again
        assert [agreements[f - 1] for f in (3, 4, 5, 6, 7, 8, 9, 10, 11, 17, 18)] == [1, 1, 0, 1, 0, 0, 0, 1, 0, 0, 1]
        assert resident == 16 + 2, resident  # resident again from forward 21 (20 made it so)


def test_without_the_fetch_order_check_resident_decoding_runs_no_collective():
    for same, raised, agreements, resident in run_ranks(2, _schedule_case, False, timeout=60):
        assert all(same) and raised == []
        assert sum(agreements) == 0 and resident == 20, (agreements, resident)


def _leaving_case():
    from zero_ext.zero import FetchOrderError, ZeroModel

    torch.manual_seed(0)
    model = _Branchy()
    zm = ZeroModel(model, param_persistence_threshold=0)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for f in range(1, 6):  # resident forwards 1-3; forward 5 (resident 3) branches on rank 1, unchecked
            model.on_rank_1 = f == 5
            model(x)
    model.on_rank_1 = False
    try:
        model(x).sum().backward()  # training goes on: the forward checks first
        message = None
    except FetchOrderError as exc:
        message = str(exc)
    model(x).sum().backward()  # and the next one records again
    zm.destroy()
    return message


def test_a_forward_with_autograd_checks_what_the_last_check_did_not_see():
    for message in run_ranks(2, _leaving_case, timeout=60):
        assert message is not None and "leaving decoding" in message and "forward 3 left the trace" in message


def _skip_case():
    from zero_ext.zero import FetchOrderError, ZeroModel

    torch.manual_seed(0)
    model = _Branchy()
    zm = ZeroModel(model, param_persistence_threshold=0)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for f in range(1, 5):  # forward 4 is resident forward 2, checked at its end; rank 1 skips b there
            model.skip_on_rank_1 = f == 4
            try:
                model(x)
                message = None
            except FetchOrderError as exc:
                message = str(exc)
    zm.destroy()
    return message


def test_a_module_skipped_on_one_rank_is_named_too():
    for message in run_ranks(2, _skip_case, timeout=60):
        assert message is not None and ("rank 1: checking after 2 resident forward(s); forward 2 ended after 1 "
                                        "of the trace's 2 fetches (the next is the forward of module 'b' (Linear))"
                                        ) in message, message


def _backward_after_decoding_case():
    from zero_ext.zero import ZeroModel

    torch.manual_seed(0)
    model, plain = _Branchy(), _Branchy()
    plain.load_state_dict(model.state_dict())
    zm = ZeroModel(model, param_persistence_threshold=0)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank()))
    loss, ref = model(x).pow(2).sum(), plain(x).pow(2).sum()  # a graph from before the decoding
    with torch.no_grad():
        outs = [torch.equal(model(x), plain(x)) for _ in range(5)]
    resident = zm.coordinator.residency is not None
    loss.backward()
    ref.backward()
    grads = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters())
                if q.grad is not None)
    after = zm.coordinator.residency is None and all(p.numel() == 0 for p in model.parameters())
    zm.destroy()
    return outs, resident, grads, after


def test_a_backward_after_resident_decoding_has_the_plain_gradients_and_ends_residency():
    for outs, resident, grads, after in run_ranks(2, _backward_after_decoding_case, timeout=60):
        assert all(outs) and resident and grads and after, (outs, resident, grads, after)


def _streaming_case():
    from zero_ext.zero import ZeroModel, fetch

    torch.manual_seed(0)
    model = _Branchy()
    zm = ZeroModel(model, param_persistence_threshold=0, max_live_parameters=150)  # the model is 216
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            model(x)
        before = fetch.agreements()
        model(x)
        per_forward = fetch.agreements() - before
    resident, streamed = zm.coordinator.stats.resident_forwards, zm.coordinator.stats.streamed_forwards
    zm.destroy()
    return resident, streamed, per_forward


def test_a_model_over_max_live_parameters_streams_instead():
    # (streaming decoding and its checks: tests/test_zero_streaming.py)
    for resident, streamed, per_forward in run_ranks(2, _streaming_case, timeout=60):
        assert resident == 0 and streamed == 2 and per_forward <= 1, (resident, streamed, per_forward)
