"""ZeRO-3's persistent parameters after a checkpoint save: whole again (as after a load or a step, and as
DeepSpeed's checkpoint epilogue leaves them), even when empty_partition_cache released them before."""
import torch

from helpers.harness import run_ranks
from helpers.models import MLP


def _save_after_release(tmp):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20}}
    engine, *_ = zero_ext.initialize(model=model, config=config)
    engine.backward(model.loss(MLP.batch(2, torch.Generator().manual_seed(1))))
    engine.step()
    # a parameter is persistent below the threshold: the biases (13 and 5 elements), not the weights
    persistent = {n: p for n, p in model.named_parameters() if p.ds_numel < 20}
    engine.empty_partition_cache()
    released = all(p.numel() == 0 for p in persistent.values())
    engine.save_checkpoint(tmp, tag="t")
    whole = {n: p.detach().clone() for n, p in persistent.items()}
    with zero_ext.zero.GatheredParameters(list(persistent.values())):
        gathered = {n: p.detach().clone() for n, p in persistent.items()}
    same = sorted(persistent) == ["body.bias", "frozen.bias", "head.bias"] and all(
        whole[n].shape == gathered[n].shape == p.ds_shape and torch.equal(whole[n], gathered[n])
        for n, p in persistent.items())
    engine.destroy()
    return released, same


def test_save_leaves_persistent_parameters_whole(tmp_path):
    for released, same in run_ranks(2, _save_after_release, str(tmp_path)):
        assert released and same
