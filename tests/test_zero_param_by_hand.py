"""DeepSpeed's gathering by hand on ZeRO-3 parameters: ``param.all_gather()``, ``all_gather_coalesced``,
``partition()`` (with ``has_been_updated``) and MultipleAllGatherHandles, on 2 gloo ranks of a stage 3
engine: the full values, their lifetime across forwards, the engine's master following an update, and
ranks that gather different parameters failing by name."""
import torch

from helpers.harness import run_ranks
from helpers.models import MLP

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.0}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _by_hand():
    import zero_ext
    from zero_ext.zero import GatheredParameters, ZeroParamStatus
    from zero_ext.zero.ds_param_methods import MultipleAllGatherHandles

    torch.manual_seed(0)
    plain = MLP()
    torch.manual_seed(0)
    engine = zero_ext.initialize(model=MLP(), config=CONFIG)[0]
    body, head = engine.module.body.weight, engine.module.head.weight
    out = {"before": body.ds_status.name}
    body.all_gather()
    out["gathered"] = body.ds_status.name, torch.equal(body.data, plain.body.weight)
    engine.module.loss(MLP.batch(2, torch.Generator().manual_seed(1)))  # a forward gathers and releases it
    out["after_forward"] = body.ds_status.name
    body.partition()
    out["partitioned"] = body.ds_status.name, tuple(body.data.shape)

    handle = head.all_gather_coalesced([head, body])
    MultipleAllGatherHandles([handle]).wait(handle_dependency=False)
    out["coalesced"] = [p.ds_status.name for p in (head, body)], torch.equal(head.data, plain.head.weight)
    with torch.no_grad():
        body.data.add_(1.0)  # the same change on every rank, kept by has_been_updated
    body.partition(param_list=[head, body], has_been_updated=True)
    with GatheredParameters([body, head]):
        out["updated"] = (torch.equal(body.data, plain.body.weight + 1.0), torch.equal(head.data, plain.head.weight))
    # the engine's fp32 master followed the new piece: a step at lr 0 writes the master back unchanged
    loss = engine.module.loss(MLP.batch(2, torch.Generator().manual_seed(1)))
    engine.backward(loss)
    engine.step()
    with GatheredParameters([body]):
        out["after_step"] = torch.equal(body.data, plain.body.weight + 1.0)
    out["async"] = body.all_gather(async_op=True) is not None
    body.partition()
    out["released"] = body.ds_status is ZeroParamStatus.NOT_AVAILABLE
    engine.destroy()
    return out


def test_gathering_by_hand_holds_the_full_value_until_partition_and_updates_follow():
    for out in run_ranks(2, _by_hand):
        assert out["before"] == "NOT_AVAILABLE"
        assert out["gathered"] == ("AVAILABLE", True)
        assert out["after_forward"] == "AVAILABLE"  # held by hand through the module's release
        assert out["partitioned"] == ("NOT_AVAILABLE", (0,))
        assert out["coalesced"] == (["AVAILABLE", "AVAILABLE"], True)
        assert out["updated"] == (True, True)
        assert out["after_step"] is True
        assert out["async"] is True and out["released"] is True


def _different_params():
    import zero_ext
    from zero_ext.zero.fetch import FetchOrderError

    torch.manual_seed(0)
    engine = zero_ext.initialize(model=MLP(), config=CONFIG)[0]
    mine = engine.module.body.weight if torch.distributed.get_rank() == 0 else engine.module.head.weight
    try:
        mine.all_gather()
        return "gathered"
    except FetchOrderError as e:
        return str(e)
    finally:
        engine.destroy()


def test_ranks_gathering_different_parameters_fail_by_name():
    for message in run_ranks(2, _different_params):
        assert "body.weight" in message and "head.weight" in message, message


def test_multiple_handles_pass_handle_dependency_by_keyword():
    from zero_ext.zero.ds_param_methods import MultipleAllGatherHandles

    class Handle:
        def wait(self, *, handle_dependency):
            self.seen = handle_dependency

    handles = [Handle(), Handle()]
    MultipleAllGatherHandles(handles).wait(handle_dependency=False)
    assert [h.seen for h in handles] == [False, False]
