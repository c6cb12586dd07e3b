"""engine.offload_states() / reload_states(): placement by tier, bit-for-bit round trips, guards."""
import pytest
import torch

from helpers.harness import RankFailed, run_ranks
from helpers.models import MLP

KIND_OF_MEMORY = {"optim_states": ["optimizer_state"], "hp_params": ["fp32_master"], "lp_params": ["params"],
                  "lp_grads": ["grads", "fp32_grads"], "contiguous_grad_buffer": ["comm_buffers"]}


def _engine(stage, dtype, offload=False):
    """offload: ZeRO-Offload's own placement (masters, gradients and state already in host memory)."""
    import zero_ext

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": dtype == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 50}}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return zero_ext.initialize(model=MLP(), config=config)[0]


def _train(engine, steps, seed):
    gen = torch.Generator().manual_seed(seed + torch.distributed.get_rank())
    dt = next(engine.module.parameters()).dtype
    for _ in range(steps):
        engine.backward(engine.module.loss(MLP.batch(2, gen, dt)))
        engine.step()


def _snapshot(engine):
    from zero_ext import utils

    ps = [p for p in engine.module.parameters() if p.requires_grad]
    return ([utils.safe_get_local_fp32_param(p) for p in ps] +
            [utils.safe_get_local_optimizer_state(p, k) for p in ps for k in ("exp_avg", "exp_avg_sq")] +
            [p.detach().clone() for p in engine.module.parameters()])


def _round_trips(stage, dtype, offload=False):
    from zero_ext import OffloadStateTypeEnum
    from zero_ext.engine import StepPhase
    from zero_ext.comm import native
    from zero_ext.runtime.zero.offload_states import get_state_devices

    engine = _engine(stage, dtype, offload)
    _train(engine, 2, 0)
    report = {}
    for kind in [None] + [k.value for k in OffloadStateTypeEnum]:
        before = _snapshot(engine)
        table_before = engine.memory_breakdown()
        engine.offload_states(include=None if kind is None else [kind])
        table = engine.memory_breakdown()
        devices = {k.value: get_state_devices(engine, k) for k in OffloadStateTypeEnum}
        errors = []
        x = MLP.batch(2, torch.Generator(), next(engine.module.parameters()).dtype)[0]
        for call in (lambda: engine.step(), lambda: engine(x)):
            try:
                engine.phase = StepPhase.BACKWARD  # reach the boundary check of step()
                call()
            except RuntimeError as exc:
                errors.append(str(exc))
        engine.phase = StepPhase.IDLE
        engine.reload_states()
        after = _snapshot(engine)
        report[kind] = {"same": all(torch.equal(a, b) for a, b in zip(before, after)), "before": table_before,
                        "offloaded": table, "reloaded": engine.memory_breakdown(), "devices": devices,
                        "errors": errors, "transport": native.buffer_bytes()}
    _train(engine, 2, 1)
    return report, [p.detach().clone() for p in engine.module.parameters()]


def _no_round_trip(stage, dtype, offload=False):
    engine = _engine(stage, dtype, offload)
    _train(engine, 2, 0)
    _train(engine, 2, 1)
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage,dtype,offload", [(0, "fp32", False), (1, "bf16", False), (2, "fp32", False),
                                                 (2, "bf16", False), (3, "fp32", False), (3, "bf16", False),
                                                 (1, "fp32", True), (2, "bf16", True), (3, "bf16", True)])
def test_round_trips_are_bit_exact_and_move_the_kind_to_the_host_tier(stage, dtype, offload):
    (report, params), _ = run_ranks(2, _round_trips, stage, dtype, offload)
    reference = run_ranks(2, _no_round_trip, stage, dtype, offload)[0]
    assert all(torch.equal(a, b) for a, b in zip(params, reference))  # training went on as if nothing happened
    for kind, r in report.items():
        assert r["same"], kind
        # everything returns to the accelerator tier (bucket buffers come back at the next backward)
        assert {k: v for k, v in r["reloaded"].items() if k not in ("comm_buffers", "total")} == \
            {k: v for k, v in r["before"].items() if k not in ("comm_buffers", "total")}, kind
        moved = [m for k, ms in KIND_OF_MEMORY.items() if kind is None or k == kind for m in ms]
        for memory_kind in moved:
            before = r["before"][memory_kind]["accelerator"]
            if memory_kind == "comm_buffers":  # freed, not copied (all but the native transport's share)
                assert r["offloaded"][memory_kind]["accelerator"] == r["transport"]
            elif memory_kind == "fp32_master" and dtype == "fp32" and not offload:
                assert r["offloaded"][memory_kind] == r["before"][memory_kind]  # it is the params: nothing to move
            elif memory_kind == "params" and stage == 3:
                # the pieces move; the whole values of persistent parameters are released, not moved
                assert r["offloaded"][memory_kind]["accelerator"] == 0
                assert 0 < r["offloaded"][memory_kind]["host"] < before
            else:  # (with ZeRO-Offload, masters, fp32 gradients and state are in host memory already)
                assert r["offloaded"][memory_kind]["accelerator"] == 0, (kind, memory_kind)
                assert r["offloaded"][memory_kind]["host"] == before + r["before"][memory_kind]["host"], \
                    (kind, memory_kind)
        assert "offloaded to host memory; call engine.reload_states() first" in r["errors"][0]  # step()
        if kind in (None, "lp_params"):
            assert "engine.forward: lp_params are offloaded" in r["errors"][1]
        else:
            assert len(r["errors"]) == 1  # forward runs
        assert r["devices"]["optim_states"] == {torch.device("cpu")}


def _step_while_offloaded():
    engine = _engine(1, "fp32")
    _train(engine, 1, 0)
    engine.offload_states(include=["optim_states"])
    _train(engine, 1, 0)


def test_step_while_offloaded_is_an_error():
    with pytest.raises(RankFailed, match=r"engine.step: optim_states are offloaded .*reload_states\(\) first"):
        run_ranks(1, _step_while_offloaded)
