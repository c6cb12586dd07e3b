"""The ZeRO-3 prefetch coordinator ([Note: ZeRO-3 prefetch trace] in zero_ext/zero/coordinator.py).

- the live set: gathered elements never exceed max(stage3_max_live_parameters, the largest single
  fetch) plus the persistent parameters, sampled at every module's forward and at every gradient in
  backward (the model's own GatherMeter, checked against the parameters' statuses), while the same
  run without the limit goes far past it;
- prefetching is used from the step after the recording one, and the results are bit-identical to
  plain PyTorch and to fetching on demand;
- a branch that changes between steps (the same on every rank) invalidates the trace, which is
  recorded again, and the results stay bit-identical;
- max_reuse_distance keeps a parameter used twice in a forward gathered (counted gathers).
"""
import logging

import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.models import TinyGPT
from helpers.zero3 import grads, rank, same_tensors

ON_DEMAND = {"prefetch_bucket_size": 0, "max_reuse_distance": 0}


def _gathered_now(zm):
    """The truth the meter must match: elements of non-persistent parameters not partitioned now."""
    from zero_ext.zero import ZeroParamStatus

    return sum(zp.numel for zp in zm.params if not zp.persist and zp.status is not ZeroParamStatus.NOT_AVAILABLE)


# -- the live set ---------------------------------------------------------------------------------------

def _chain():
    # weights of 128, 512, 512, 384 and 192 elements; biases (<= 32) persistent
    sizes = [8, 16, 32, 16, 24, 8]
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers)


def _live_set(max_live):
    import zero_ext.zero as zero

    torch.manual_seed(0)
    with zero.Init():
        model = _chain()
    zm = zero.ZeroModel(model, param_persistence_threshold=32, max_live_parameters=max_live,
                        prefetch_bucket_size=10_000)
    samples = []  # (truth, meter) at each sampling point

    def sample(*_):
        samples.append((_gathered_now(zm), zm.meter.live))
    for m in model:
        m.register_forward_pre_hook(sample)  # after ZeroModel's own (prepended): the module's fetch is done
        m.register_forward_hook(sample)
    zm.register_grad_ready_hook(lambda zp: sample())
    gen = torch.Generator().manual_seed(rank())
    for _ in range(4):
        model(torch.randn(3, 8, generator=gen)).pow(2).mean().backward()
    largest = max(sum(p.ds_numel for p in m.parameters(recurse=False) if not p.ds_persist) for m in model)
    persistent = sum(zp.numel for zp in zm.persistent)
    result = {"samples": samples, "peak": zm.meter.peak, "largest": largest, "persistent": persistent,
              "stats": zm.coordinator.stats.as_dict(), "after": _gathered_now(zm)}
    zm.destroy()
    return result


def test_live_set_stays_within_max_live_parameters():
    max_live = 700  # above the largest fetch (512), below the model's 1728 partitioned elements
    for r, res in enumerate(run_ranks(2, _live_set, max_live, timeout=60)):
        bound = max(max_live, res["largest"])
        assert res["largest"] == 512
        assert all(truth == meter for truth, meter in res["samples"]), f"rank {r}: the meter is off"
        most = max(truth for truth, _ in res["samples"])
        assert most <= bound and res["peak"] <= bound, f"rank {r}: {most} / peak {res['peak']} > {bound}"
        assert res["stats"]["prefetched"] > 0, "prefetching must happen within the limit too"
        assert res["after"] == 0 and res["persistent"] == 16 + 32 + 16 + 24 + 8
    # the control: without the limit the same run keeps far more gathered (the bound above means something)
    for res in run_ranks(2, _live_set, 10 ** 9, timeout=60):
        assert res["peak"] > 2 * max_live


def test_a_module_larger_than_the_limit_is_still_gathered():
    for res in run_ranks(2, _live_set, 100, timeout=60):  # every weight but the first exceeds 100 elements
        assert res["peak"] <= max(100, res["largest"])
        assert all(truth == meter for truth, meter in res["samples"])


# -- prefetching is used, results bit-identical -----------------------------------------------------------

def _train(options, steps, plan=None):
    """Plain PyTorch and ZeRO-3 (ZeroModel with ``options``) side by side on TinyGPT or Switchy; returns
    both losses, gradient and statistics per step."""
    import zero_ext.zero as zero

    build = TinyGPT if plan is None else Switchy
    torch.manual_seed(7)
    ref = build()
    torch.manual_seed(7 + 100 * rank())
    with zero.Init():
        model = build()
    zm = zero.ZeroModel(model, param_persistence_threshold=0, **options)
    log = _LogCapture()
    gen = torch.Generator().manual_seed(1000 + rank())
    result = {"ref": [], "zero": [], "stats": [], "gathers": []}
    for step in range(steps):
        batch = build.batch(3, gen)
        if plan is None:
            losses = ref.loss(batch), model.loss(batch)
        else:
            losses = ref.loss(batch, plan[step]), model.loss(batch, plan[step])
        for key, loss in zip(("ref", "zero"), losses):
            result[key].append(loss.item())
            loss.backward()
        result["stats"].append(zm.coordinator.stats.as_dict())
        result["gathers"].append(zm.meter.gathers)
    result["grads_differ"] = same_tensors(grads(ref), grads(model))
    result["exact"] = [a == b for a, b in zip(result["ref"], result["zero"])]
    result["log"] = log.close()
    zm.destroy()
    return result


class _LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []
        self.logger = logging.getLogger("zero_ext.zero.coordinator")
        self.level_before = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self)

    def emit(self, record):
        self.messages.append(f"{record.levelname}: {record.getMessage()}")

    def close(self):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        return self.messages


def test_prefetch_is_used_after_the_first_step_and_results_are_bit_identical():
    steps = 5
    prefetching = run_ranks(2, _train, {}, steps, timeout=90)
    on_demand = run_ranks(2, _train, ON_DEMAND, steps, timeout=90)
    for r, (pre, dem) in enumerate(zip(prefetching, on_demand)):
        assert all(pre["exact"]) and pre["grads_differ"] == [], f"rank {r}: differs from plain PyTorch"
        assert pre["zero"] == dem["zero"], f"rank {r}: prefetching changed the losses"
        first, last = pre["stats"][0], pre["stats"][-1]
        assert first["prefetched"] == first["served_ahead"] == 0  # the recording step fetches on demand
        # TinyGPT's tied embedding is found external in step 1, which changes step 2's fetches: the
        # trace recorded then is followed from step 3 on
        assert last["traced_steps"] >= steps - 3 and last["prefetched"] > 0 and last["served_ahead"] > 0
        assert last["invalidations"] <= 1
        on_demand_stats = dem["stats"][-1]
        assert on_demand_stats["prefetched"] == 0
        # the defaults keep every parameter from its forward to its backward: fewer gathers per step
        per_step = pre["gathers"][-1] - pre["gathers"][-2]
        assert per_step < dem["gathers"][-1] - dem["gathers"][-2]


# -- a branch that changes between steps ------------------------------------------------------------------

class Switchy(nn.Module):
    """stem, then ``left`` or ``right`` (same shapes), then head: the branch is chosen per step."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 10)
        self.left = nn.Linear(10, 10)
        self.right = nn.Linear(10, 10)
        self.head = nn.Linear(10, 3)

    def forward(self, x, go_left):
        h = torch.tanh(self.stem(x))
        h = torch.tanh(self.left(h) if go_left else self.right(h))
        return self.head(h)

    def loss(self, batch, go_left):
        x, y = batch
        return (self(x, go_left) - y).pow(2).mean()

    @staticmethod
    def batch(n, gen):
        return torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)


def test_a_changed_branch_invalidates_the_trace_and_results_stay_right():
    plan = [True, True, True, False, False, False, True, True]  # the same on every rank
    for r, res in enumerate(run_ranks(2, _train, {}, len(plan), plan, timeout=90)):
        assert all(res["exact"]) and res["grads_differ"] == [], f"rank {r}"
        stats = res["stats"]
        # recorded in step 0, followed in 1-2; step 3 leaves it, 4 records, 5 follows, 6 leaves, 7 records
        assert [s["invalidations"] for s in stats] == [0, 0, 0, 1, 1, 1, 2, 2]
        assert [s["traced_steps"] for s in stats] == [0, 1, 2, 3, 3, 4, 5, 5]
        assert stats[2]["served_ahead"] > stats[1]["served_ahead"] > 0
        assert stats[5]["served_ahead"] > stats[4]["served_ahead"]  # followed again after re-recording
        assert sum("fetch trace invalidated" in m for m in res["log"]) == 2
        assert any("'right' (Linear), the trace has the forward of module 'left' (Linear)" in m for m in res["log"])


def test_log_trace_cache_warnings_makes_the_invalidation_a_warning():
    plan = [True, True, False]
    for options, level in (({}, "DEBUG"), ({"log_trace_cache_warnings": True}, "WARNING")):
        for res in run_ranks(2, _train, options, len(plan), plan, timeout=60):
            assert [m.split(":")[0] for m in res["log"] if "invalidated" in m] == [level]


# -- max_reuse_distance -----------------------------------------------------------------------------------

class Twice(nn.Module):
    """``a`` runs twice in each forward, ``b`` (36 elements) between: a(tanh(b(a(x))))."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6, bias=False)
        self.b = nn.Linear(6, 6, bias=False)

    def forward(self, x):
        return self.a(torch.tanh(self.b(self.a(x))))


def _reuse(distance):
    import zero_ext.zero as zero

    torch.manual_seed(3)
    ref = Twice()
    torch.manual_seed(3)
    with zero.Init():
        model = Twice()
    zm = zero.ZeroModel(model, param_persistence_threshold=0, prefetch_bucket_size=0, max_reuse_distance=distance)
    counts, exact = [], []
    gen = torch.Generator().manual_seed(rank())
    for _ in range(3):
        before = (model.a.weight._zero_owner.gathers, model.b.weight._zero_owner.gathers)
        x = torch.randn(2, 6, generator=gen)
        loss_ref, loss = ref(x).pow(2).sum(), model(x).pow(2).sum()
        exact.append(torch.equal(loss_ref, loss))
        loss_ref.backward()
        loss.backward()
        counts.append((model.a.weight._zero_owner.gathers - before[0], model.b.weight._zero_owner.gathers - before[1]))
    result = (counts, exact, same_tensors(grads(ref), grads(model)))
    zm.destroy()
    return result


def test_max_reuse_distance_keeps_a_parameter_used_twice_gathered():
    # fetches of a step: a, b, a (forward), a, b, a (backward: second call first). The recording step
    # gathers a at each of its four fetches; afterwards a parameter is kept when fewer than the distance's
    # elements are fetched before its next use (DeepSpeed's count):
    # - distance 0: nothing is kept (a: 4 gathers, b: 2);
    # - distance 36 (b's size): a only from its second forward to its backward right after (3 gathers);
    # - distance 37: a is kept across b every time (1 gather), b is not across two a's (2);
    # - unlimited: everything is kept until it is used again.
    expected = {0: (4, 2), 36: (3, 2), 37: (1, 2), 10 ** 9: (1, 1)}
    for distance, (a, b) in expected.items():
        for counts, exact, grads_differ in run_ranks(2, _reuse, distance, timeout=60):
            assert counts[0] == (4, 2), distance
            assert counts[1:] == [(a, b)] * 2, distance
            assert all(exact) and grads_differ == []
