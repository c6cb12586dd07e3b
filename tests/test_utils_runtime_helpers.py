"""deepspeed.runtime.utils' helpers on plain parameter lists (zero_ext/utils/runtime_utils.py): clipping and
the overflow check with expert (MoE) parameters whose gradients differ by rank, on 2 gloo ranks, against
what each rank computes by hand; call_to_str; count_used_parameters_in_backward from a hook."""
import math

import pytest
import torch

from helpers.harness import run_ranks


def _param(value: float, grad: float, expert: bool = False) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.tensor([value]))
    p.grad = torch.tensor([grad])
    if expert:
        p.allreduce, p.group_name = False, "ep_size_2"
    return p


def _clip_and_overflow():
    import torch.distributed as dist

    from zero_ext.moe import groups
    from zero_ext.utils.runtime_utils import CheckOverflow, clip_grad_norm_, get_weight_norm

    rank = dist.get_rank()
    groups.create_expert_and_data_parallel(2)
    dense, expert = _param(0.0, 1.0), _param(0.0, rank + 1.0, expert=True)
    norm = clip_grad_norm_([dense, expert], max_norm=0.1)
    # each rank's own norm, averaged over the two ranks; both gradients scaled by max_norm / norm
    want = (math.sqrt(1 + 1) + math.sqrt(1 + 4)) / 2
    out = {"norm": float(norm), "want": want, "dense": float(dense.grad), "coef": 0.1 / (want + 1e-6)}
    finite = CheckOverflow([[_param(0.0, 1.0), _param(0.0, 2.0, expert=True)]]).check()
    # an inf in rank 1's expert gradient only: both ranks of the expert-parallel group see it
    inf = CheckOverflow([[_param(0.0, 1.0), _param(0.0, float("inf") if rank else 1.0, expert=True)]]).check()
    by_norm = CheckOverflow([[expert]]).check_using_norm([get_weight_norm([_param(float("nan") if rank else 1.0, 0.0)])],
                                                         reduce_overflow=False)
    out.update(finite=finite, inf=inf, by_norm=by_norm)
    return out


def test_clip_and_overflow_with_expert_parameters_agree_across_ranks():
    for out in run_ranks(2, _clip_and_overflow, timeout=60):
        assert out["norm"] == pytest.approx(out["want"], rel=1e-6)
        assert out["dense"] == pytest.approx(out["coef"], rel=1e-6)
        assert out["finite"] is False and out["inf"] is True and out["by_norm"] is True


def test_clip_grad_norm_on_one_process_matches_torch():
    from zero_ext.utils.runtime_utils import clip_grad_norm_

    mine, theirs = [_param(0.0, 1.0), _param(0.0, 1.0)], [_param(0.0, 1.0), _param(0.0, 1.0)]
    clip_grad_norm_(mine, max_norm=0.1)
    torch.nn.utils.clip_grad_norm_(theirs, 0.1)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs))
    assert float(clip_grad_norm_([_param(0.0, -3.0), _param(0.0, 2.0)], 10.0, norm_type=math.inf)) == 3.0


def test_call_to_str():
    from zero_ext.utils.runtime_utils import call_to_str

    assert call_to_str("f") == "f()" and call_to_str("f", 3, "a") == "f(3, 'a')"
    assert call_to_str("g", 1, val=[2]) == "g(1, val=[2])"


def test_count_used_parameters_in_backward():
    from zero_ext.utils.runtime_utils import count_used_parameters_in_backward

    used, unused, frozen = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    frozen.requires_grad_(False)
    seen = {}

    def hook(grad):
        seen["count"] = count_used_parameters_in_backward([used, unused, frozen, used])
        return grad

    used.register_hook(hook)
    (used * 2).sum().backward()
    assert seen["count"] == 1
    with pytest.raises(RuntimeError, match="during a backward"):
        count_used_parameters_in_backward([used])
