"""Ranks that fetch different parameters (a rank-dependent branch) get an error naming the module and
parameter on every rank, instead of a deadlock or silently mixed pieces ([Note: fetch-order
agreement] in zero_ext/zero/fetch.py)."""
import pytest
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.zero3 import rank


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.branch_a = nn.Linear(4, 4)
        self.branch_b = nn.Linear(4, 4)  # same shapes as branch_a: gathering it instead would "work"
        self.wide = nn.Linear(4, 9)  # another shape: the all-gathers would not even match in size
        self.extra = nn.Linear(4, 4)

    def forward(self, x, plan):
        h = self.stem(x)
        for name in plan:
            h = getattr(self, name)(h)
        return h


PLANS = {
    "same-shape branches": (["branch_a"], ["branch_b"]),
    "different shapes": (["branch_a"], ["wide"]),
    "extra module on rank 0": (["extra", "branch_a"], ["branch_a"]),
}


def _diverge(case, check):
    import zero_ext.zero as zero

    torch.manual_seed(0)
    with zero.Init():
        model = Branchy()
    zm = zero.ZeroModel(model, param_persistence_threshold=0, check_fetch_order=check)
    plan = PLANS[case][min(rank(), 1)]
    try:
        model(torch.ones(2, 4), plan)
        message = ""
    except zero.FetchOrderError as exc:
        message = str(exc)
    state = [n for n, p in model.named_parameters() if p.numel() or p.ds_tensor is None]
    # the group is still usable: a forward that agrees runs
    recovered = tuple(model(torch.ones(2, 4), ["branch_a"]).shape)
    zm.destroy()
    return message, state, recovered


@pytest.mark.parametrize("case", list(PLANS))
def test_divergent_fetch_raises_on_every_rank(case):
    results = run_ranks(2, _diverge, case, True, timeout=60)
    a, b = PLANS[case][0][0], PLANS[case][1][0]
    for message, state, recovered in results:
        assert "ranks are about to gather different parameters" in message
        assert f"rank 0: forward of module '{a}' (Linear)" in message
        assert f"rank 1: forward of module '{b}' (Linear)" in message
        assert f"'{a}.weight'" in message and f"'{b}.weight'" in message
        assert state == [] and recovered == (2, 4)


def test_check_can_be_turned_off():
    # same shapes: without the check nothing notices (each rank mixes pieces of two different layers)
    for message, state, recovered in run_ranks(2, _diverge, "same-shape branches", False, timeout=60):
        assert message == "" and state == []


def _gathered_diverge():
    import zero_ext.zero as zero

    with zero.Init():
        a, b = nn.Linear(3, 3), nn.Linear(3, 5)
    try:
        with zero.GatheredParameters(a.weight if rank() == 0 else b.weight):
            pass
        return ""
    except zero.FetchOrderError as exc:
        return str(exc)


def test_gathered_parameters_divergence_is_reported():
    for message in run_ranks(2, _gathered_diverge, timeout=60):
        assert "rank 0: GatheredParameters(modifier_rank=None): 1 parameter(s), 9 elements" in message
        assert "rank 1: GatheredParameters(modifier_rank=None): 1 parameter(s), 15 elements" in message


def _init_diverge():
    import zero_ext.zero as zero

    try:
        with zero.Init():
            nn.Linear(3, 3 if rank() == 0 else 5)
            nn.Linear(2, 2)  # its first allocation partitions the finished module above
        return ""
    except zero.FetchOrderError as exc:
        return str(exc)


def test_different_models_under_init_are_reported():
    for message in run_ranks(2, _init_diverge, timeout=60):
        assert "rank 0: partitioning (zero.Init): 2 parameter(s), 12 elements" in message
        assert "rank 1: partitioning (zero.Init): 2 parameter(s), 20 elements" in message


# -- along a recorded trace (prefetching): the agreement runs once per batch, the guarantee stays ---------

def _diverge_after_trace(case):
    import zero_ext.zero as zero

    torch.manual_seed(0)
    with zero.Init():
        model = Branchy()
    zm = zero.ZeroModel(model, param_persistence_threshold=0)
    same, mine = PLANS[case][0], PLANS[case][min(rank(), 1)]
    for _ in range(3):  # recorded in the first step, followed (and prefetched) in the next two
        model(torch.ones(2, 4), same).sum().backward()
    followed = zm.coordinator.stats.as_dict()
    try:
        model(torch.ones(2, 4), mine).sum().backward()
        message = ""
    except zero.FetchOrderError as exc:
        message = str(exc)
    state = [n for n, p in model.named_parameters() if p.numel()]
    recovered = tuple(model(torch.ones(2, 4), ["branch_a"]).shape)
    zm.destroy()
    return message, followed, state, recovered


@pytest.mark.parametrize("case", list(PLANS))
def test_divergence_after_the_trace_was_recorded_raises_on_every_rank(case):
    b = PLANS[case][1][0]  # the module rank 1 runs where it leaves the trace
    for r, (message, followed, state, recovered) in enumerate(run_ranks(2, _diverge_after_trace, case, timeout=60)):
        assert followed["traced_steps"] == 2 and followed["prefetched"] > 0
        assert "ranks are about to gather different parameters" in message, f"rank {r}: {message!r}"
        assert f"rank 1: forward of module '{b}' (Linear)" in message and f"'{b}.weight'" in message
        assert "rank 0: " in message
        assert state == [] and recovered == (2, 4)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.head_a = nn.Linear(8, 3)
        self.head_b = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        return self.head_a(h), self.head_b(h)


def _diverge_in_backward():
    import zero_ext

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "reduce_bucket_size": 20, "overlap_comm": True}}
    engine = zero_ext.initialize(model=TwoHeads(), config=config)[0]
    for step in range(4):
        a, b = engine(torch.ones(2, 4))
        # the same forward everywhere; in the last step rank 1's loss leaves head_b out, so its backward
        # skips head_b's: ranks that agreed on the trace now fetch in different orders during backward
        loss = a.sum() + (b.sum() if step < 3 or rank() == 0 else 0)
        try:
            engine.backward(loss)
        except zero_ext.zero.FetchOrderError as exc:
            return step, str(exc), engine.zero_model.coordinator.stats.as_dict()
        engine.step()
    return step, "", {}


def test_divergence_in_backward_raises_before_a_gradient_reduction_hangs():
    for step, message, stats in run_ranks(2, _diverge_in_backward, timeout=60):
        assert step == 3 and stats["traced_steps"] == 3
        assert "ranks are about to gather different parameters" in message
        assert "rank 0: following the recorded trace, last fetch by module 'head_b' (Linear)" in message
        assert "rank 1: backward of module 'head_a' (Linear): 2 parameter(s), 27 elements" in message


def _names_after_one_rank_partitioned_alone():
    import torch.distributed as dist
    from zero_ext.zero.convert import partition_module, partition_params
    from zero_ext.zero.fetch import FetchOrderError

    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # (every rank makes every group)
    if rank() == 0:  # a rank-0-only tool partitions a parameter of its own: rank 0's ds_ids run ahead
        partition_params([nn.Parameter(torch.ones(3))], group=alone[0])
    model = Branchy()
    zps = partition_module(model)
    ids = [zp.ds_id for zp in zps]
    mine = model.branch_a.weight if rank() == 0 else model.wide.weight
    try:
        mine.all_gather()
    except FetchOrderError as e:
        return ids, str(e)
    return ids, "gathered"


def test_ds_ids_agree_after_a_rank_partitioned_alone_so_messages_name_the_right_parameters():
    (ids0, message), (ids1, _) = run_ranks(2, _names_after_one_rank_partitioned_alone)
    assert ids0 == ids1
    assert "branch_a.weight" in message and "wide.weight" in message, message
