"""DeepSpeed's optimizer attributes as read-only views of zero_ext's groups (``fp16_groups``,
``single_partition_of_fp32_groups`` at stages 1/2, ``fp32_partitioned_groups_flat`` at stage 3): the same
tensors the optimizer steps, checked against the parameters on 2 real ranks."""
import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP


def _views(stage):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, opt, *_ = zero_ext.initialize(model=model, config=config)
    engine.backward(model.loss(MLP.batch(2, torch.Generator().manual_seed(1))))
    engine.step()
    same_params = [[id(p) for p in group] for group in opt.fp16_groups] == \
        [[id(p) for p in g.params] for g in opt.flat_groups] and opt.bit16_groups == opt.fp16_groups
    wrong = "fp32_partitioned_groups_flat" if stage < 3 else "single_partition_of_fp32_groups"
    try:
        getattr(opt, wrong)
        refused = ""
    except AttributeError as exc:
        refused = str(exc)
    masters = opt.fp32_partitioned_groups_flat if stage == 3 else opt.single_partition_of_fp32_groups
    stepped = all(any(m is q for pg in opt.param_groups for q in pg["params"]) for m in masters)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if stage == 3:  # each parameter's piece, back to back; the parameter's own data empty (DeepSpeed's constant)
        from zero_ext.runtime.zero.partition_parameters import partitioned_param_data_shape

        match = all(list(p.shape) == partitioned_param_data_shape for p in model.parameters()) and all(torch.equal(m[off:off + s], p.ds_tensor.float())
                    for m, g in zip(masters, opt.flat_groups) for p, off, s in zip(g.params, g.offsets, g.shards))
    else:  # this rank's slice of the parameters laid end to end (the layout's padding aside)
        match = all(torch.equal(m, g.flat[g.lo:g.hi].float()) and g.hi - g.lo == m.numel()
                    for m, g in zip(masters, opt.flat_groups))
        parts = opt.parallel_partitioned_bit16_groups  # every rank's partition, as views of the flat buffer
        align = 2 * opt.nccl_start_alignment_factor
        match = match and all(len(ps) == world and ps[rank].data_ptr() == g.flat[g.lo:].data_ptr() and
                              all(p.data_ptr() % align == 0 for p in ps) and torch.equal(torch.cat(ps), g.flat)
                              for ps, g in zip(parts, opt.flat_groups))
        flats = opt.bit16_groups_flat  # the flat buffers themselves, outside autograd
        match = match and all(f is g.flat and f.grad_fn is None for f, g in zip(flats, opt.flat_groups))
    engine.destroy()
    return same_params, refused, stepped, match, (rank, world)


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeeds_group_attributes_are_views_of_what_is_stepped(stage):
    for same_params, refused, stepped, match, _ in run_ranks(2, _views, stage):
        assert same_params and stepped and match
        assert f"runs stage {stage}" in refused
