"""The MoE router (zero_ext/moe/gating.py) against a plain reference written here: token by token, in
token order, the way the rules read in docs/moe.md. One process; exact results (the reference computes
the same fp32 softmax, so weights are compared to 1e-6)."""
import math

import pytest
import torch
import torch.nn.functional as F

from zero_ext.moe.gating import TopKGate, capacity, top1gating, top2gating, topkgating


def _reference(gates, chosen, cap, weights_of):
    """combine [S, E, C] from per-token lists of (expert, kept) in the order slots are given out;
    chosen[s] lists token s's routes; weights_of(s, kept_experts) gives each kept route's weight."""
    S, E = gates.shape
    combine = torch.zeros(S, E, cap)
    next_slot = [0] * E
    kept = [[] for _ in range(S)]
    for s, routes in chosen:
        for e, keep in routes:
            if keep:
                kept[s].append((e, next_slot[e]))
                next_slot[e] += 1
    for s in range(S):
        w = weights_of(s, [e for e, _ in kept[s]])
        for (e, slot), value in zip(kept[s], w):
            combine[s, e, slot] = value
    return combine


def _top1_reference(logits, factor, min_cap, used=None):
    gates = F.softmax(logits, dim=1)
    S, E = gates.shape
    cap = max(math.ceil(S / E * factor), min_cap)
    first = gates.argmax(dim=1).tolist()
    used = [True] * S if used is None else [bool(u) for u in used]
    counts = [sum(1 for s in range(S) if used[s] and first[s] == e) for e in range(E)]
    taken = [0] * E
    chosen = []
    for s in range(S):
        if used[s]:
            chosen.append((s, [(first[s], taken[first[s]] < cap)]))
            taken[first[s]] += 1
    combine = _reference(gates, chosen, cap, lambda s, es: [gates[s, e].item() for e in es])
    l_aux = E * sum(gates[:, e].mean().item() * counts[e] / S for e in range(E))
    return combine, counts, l_aux


def _top2_reference(logits, factor, min_cap):
    gates = F.softmax(logits, dim=1)
    S, E = gates.shape
    cap = max(math.ceil(S / E * factor * 2), min_cap)
    first = gates.argmax(dim=1).tolist()
    second = [max((e for e in range(E) if e != first[s]), key=lambda e: logits[s, e].item()) for s in range(S)]
    firsts = [first.count(e) for e in range(E)]
    taken = [0] * E
    chosen = {s: [] for s in range(S)}
    for s in range(S):  # first choices fill the slots first, in token order
        chosen[s].append((first[s], taken[first[s]] < cap))
        taken[first[s]] += 1
    for s in range(S):
        chosen[s].append((second[s], taken[second[s]] < cap))
        taken[second[s]] += 1
    # slots: all first choices in token order, then second choices
    order = [(s, [chosen[s][0]]) for s in range(S)] + [(s, [chosen[s][1]]) for s in range(S)]

    def weights(s, es):
        total = max(sum(gates[s, e].item() for e in es), torch.finfo(torch.float32).eps)
        return [gates[s, e].item() / total for e in es]

    combine = _reference(gates, order, cap, weights)
    counts = [firsts[e] + second.count(e) for e in range(E)]
    l_aux = E * sum(gates[:, e].mean().item() * firsts[e] / S for e in range(E))
    return combine, counts, l_aux


def _topk_reference(logits, k, factor, min_cap, policy):
    gates = F.softmax(logits, dim=1)
    S, E = gates.shape
    cap = max(math.ceil(S / E * factor * k), min_cap)
    picks = [set(gates[s].topk(k).indices.tolist()) for s in range(S)]
    keep = set()
    for e in range(E):
        routed = [s for s in range(S) if e in picks[s]]
        if policy == "probs":
            routed = sorted(routed, key=lambda s: -gates[s, e].item())
        keep |= {(s, e) for s in routed[:cap]}
    chosen = [(s, [(e, (s, e) in keep) for e in sorted(picks[s])]) for s in range(S)]

    def weights(s, es):
        total = max(sum(gates[s, e].item() for e in es), torch.finfo(torch.float32).eps)
        return [gates[s, e].item() / total for e in es]

    combine = _reference(gates, chosen, cap, weights)
    counts = [sum(1 for s in range(S) if e in picks[s]) for e in range(E)]
    l_aux = E / k * sum(gates[:, e].mean().item() * counts[e] / S for e in range(E))
    return combine, counts, l_aux


def _check(result, combine, counts, l_aux):
    got_aux, got_combine, dispatch, exp_counts = result
    assert got_combine.shape == combine.shape
    torch.testing.assert_close(got_combine, combine, rtol=1e-6, atol=1e-7)
    assert torch.equal(dispatch, combine > 0)
    assert exp_counts.tolist() == counts
    assert got_aux.item() == pytest.approx(l_aux, rel=1e-6)


@pytest.mark.parametrize("S,E,factor,min_cap", [(16, 4, 1.0, 0), (20, 4, 0.5, 2), (7, 3, 2.0, 4), (16, 4, 0.25, 0)])
def test_top1_matches_reference(S, E, factor, min_cap):
    torch.manual_seed(S + E)
    logits = torch.randn(S, E) * 2
    _check(top1gating(logits, factor, min_cap, use_rts=False), *_top1_reference(logits, factor, min_cap))


def test_top1_used_token_removes_tokens():
    torch.manual_seed(3)
    logits = torch.randn(12, 3)
    used = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.float32)
    result = top1gating(logits, 1.0, 0, used_token=used, use_rts=False)
    _check(result, *_top1_reference(logits, 1.0, 0, used.tolist()))
    assert result[1][used == 0].abs().sum() == 0


def test_top1_random_token_selection_keeps_a_valid_subset():
    torch.manual_seed(4)
    logits = torch.randn(32, 4) * 3
    ordered = top1gating(logits, 0.5, 0, use_rts=False)
    l_aux, combine, dispatch, counts = top1gating(logits, 0.5, 0, use_rts=True)
    assert combine.shape == ordered[1].shape  # the same capacity
    cap = combine.shape[2]
    gates = F.softmax(logits, dim=1)
    first = gates.argmax(dim=1)
    for e in range(4):
        rows = dispatch[:, e].nonzero()  # (token, slot) pairs
        assert len(rows) == min(int(counts[e]), cap)
        assert sorted(rows[:, 1].tolist()) == list(range(len(rows)))  # slots 0.. n-1, each once
        assert bool((first[rows[:, 0]] == e).all())  # only tokens that chose e
        assert rows[:, 0].tolist() == sorted(rows[:, 0].tolist())  # slots in token order
        torch.testing.assert_close(combine[rows[:, 0], e, rows[:, 1]], gates[rows[:, 0], e])
    assert dispatch.sum(dim=(1, 2)).max() <= 1
    assert l_aux.item() == pytest.approx(ordered[0].item())
    assert torch.equal(counts, ordered[3])


@pytest.mark.parametrize("S,E,factor,min_cap", [(16, 4, 1.0, 0), (12, 3, 0.5, 1), (6, 4, 2.0, 4)])
def test_top2_matches_reference(S, E, factor, min_cap):
    torch.manual_seed(S * E)
    logits = torch.randn(S, E) * 2
    _check(top2gating(logits, factor, min_cap, top2_2nd_expert_sampling=False), *_top2_reference(logits, factor, min_cap))


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("S,E,k,factor", [(16, 6, 3, 1.0), (12, 4, 3, 0.5), (10, 8, 4, 0.75)])
def test_topk_matches_reference(S, E, k, factor, policy):
    torch.manual_seed(S + E + k)
    logits = torch.randn(S, E) * 2
    _check(topkgating(logits, k, factor, 1, drop_policy=policy), *_topk_reference(logits, k, factor, 1, policy))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_without_drops_every_route_is_kept(k):
    torch.manual_seed(9)
    logits = torch.randn(24, 4) * 4  # unbalanced: some expert gets many tokens
    if k == 1:
        _, combine, dispatch, counts = top1gating(logits, 1.0, 0, drop_tokens=False)
    elif k == 2:
        _, combine, dispatch, counts = top2gating(logits, 1.0, 0, drop_tokens=False, top2_2nd_expert_sampling=False)
    else:
        _, combine, dispatch, counts = topkgating(logits, 3, 1.0, 0, drop_tokens=False)
    assert combine.shape[2] == int(counts.max())  # the largest count: nothing dropped, no slack
    assert dispatch.sum(dim=(1, 2)).tolist() == [k] * 24
    if k > 1:  # the weights of a token's routes sum to 1
        torch.testing.assert_close(combine.sum(dim=(1, 2)), torch.ones(24))


def test_sparse_routes_describe_the_dense_result():
    torch.manual_seed(11)
    logits = torch.randn(20, 5)
    for dense, sparse in [(top1gating(logits, 0.5, 0, use_rts=False), top1gating(logits, 0.5, 0, use_rts=False,
                                                                                   sparse_routes=True)),
                          (top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False),
                           top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False, sparse_routes=True)),
                          (topkgating(logits, 3, 0.5, 0), topkgating(logits, 3, 0.5, 0, sparse_routes=True))]:
        _, cap, E, indices, locations, weights, _ = sparse
        rebuilt = torch.zeros_like(dense[1])
        for r in range(indices.shape[0]):
            for s in range(20):
                if indices[r, s] >= 0:
                    rebuilt[s, indices[r, s], locations[r, s]] += weights[r, s]
        torch.testing.assert_close(rebuilt, dense[1])
        assert cap == dense[1].shape[2] and E == 5


def test_capacity_rounds_in_fp32_and_respects_the_minimum():
    assert capacity(16, 4, 1.0, 0) == 4
    assert capacity(16, 4, 1.0, 8) == 8
    assert capacity(3, 4, 8.0, 0) == 6
    assert capacity(10, 3, 1.0, 0) == 4


def test_gate_noise_policies_and_eval_factor():
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    for policy in (None, "Jitter", "RSample"):
        gate = TopKGate(8, 4, k=1, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0,
                        noisy_gate_policy=policy)
        assert gate(x)[1].shape[2] == 4  # 32 tokens / 4 experts x 0.5
        gate.eval()
        assert gate(x)[1].shape[2] == 16  # eval_capacity_factor 2.0
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(8, 4, noisy_gate_policy="Gaussian")
    with pytest.raises(ValueError, match="k=5"):
        TopKGate(8, 4, k=5)


def test_gate_gradient_reaches_its_weight():
    torch.manual_seed(1)
    gate = TopKGate(8, 4, k=2, min_capacity=0, top2_2nd_expert_sampling=False)
    l_aux, combine, _, _ = gate(torch.randn(16, 8))
    (combine.sum() * 0 + (combine ** 2).sum() + l_aux).backward()
    assert gate.wg.weight.grad is not None and gate.wg.weight.grad.abs().sum() > 0


def test_top1_refuses_fewer_tokens_than_min_capacity():
    with pytest.raises(ValueError, match="min_capacity 4"):
        top1gating(torch.randn(3, 2), 1.0, 4)
