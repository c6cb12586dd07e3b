"""stage3_use_all_reduce_for_fetch_params: ZeRO-3 gathers run as an all-reduce of zero-filled blocks.
The gathered values are the all-gather's (odd sizes with padding included, under zero.Init and by
hand), training is bit-identical to the all-gather's, and the collectives run are all-reduces."""
import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP


def _config(by_all_reduce):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_use_all_reduce_for_fetch_params": by_all_reduce}}


def _gather_under_init(numels):
    import zero_ext

    with zero_ext.zero.Init(config_dict_or_path=_config(True)):
        holder = torch.nn.ParameterList([torch.nn.Parameter(torch.arange(1.0, n + 1) - n / 2) for n in numels])
    params = list(holder)
    params[0].all_gather_coalesced(params).wait()
    return [p.data.tolist() for p in params]


@pytest.mark.parametrize("numels", [[5, 7], [4, 6]], ids=["padded", "aligned"])
def test_parameters_gathered_by_all_reduce_are_exact(numels):
    for values in run_ranks(2, _gather_under_init, numels):
        assert values == [(torch.arange(1.0, n + 1) - n / 2).tolist() for n in numels]


def _train(by_all_reduce):
    import zero_ext
    from zero_ext.comm import traffic

    torch.manual_seed(0)
    engine = zero_ext.initialize(model=MLP(), config=_config(by_all_reduce))[0]
    traffic.start()
    losses = _steps(engine)
    verbs = {verb: total for verb, (total, _) in traffic.snapshot()["by_verb"].items()}
    traffic.stop()
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return losses, weights, verbs


def _steps(engine):
    gen, losses = torch.Generator().manual_seed(1), []
    for _ in range(3):
        loss = engine.module.loss(MLP.batch(2, gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_training_is_bit_identical_to_the_all_gather_and_runs_all_reduces():
    by_reduce, by_gather = run_ranks(2, _train, True), run_ranks(2, _train, False)
    for (losses, weights, verbs), (ref_losses, ref_weights, ref_verbs) in zip(by_reduce, by_gather):
        assert losses == ref_losses
        assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
        # the parameters' gathers became all-reduces (agreement rows stay all-gathers): an all-reduce's
        # input is the whole zero-filled buffer, world x the all-gather's block
        gathered = ref_verbs["all_gather"] - verbs.get("all_gather", 0)
        assert gathered > 0 and verbs["all_reduce"] - ref_verbs["all_reduce"] == 2 * gathered, (verbs, ref_verbs)
