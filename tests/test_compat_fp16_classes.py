"""DeepSpeed's stage-0 mixed-precision optimizer classes (``deepspeed.runtime.fp16``): FP16_Optimizer
matches zero_ext's optimizer at stage 0 over a 16-bit model when the base is what DeepSpeed holds as its
FusedAdam (a config Adam/AdamW section), FP16_UnfusedOptimizer when it is another (a client torch
optimizer); stage 0's ``fp32_groups_flat`` is the whole fp32 master of each group, the tensors the
optimizer steps, and ``fp32_groups`` the same masters per parameter. Over an fp32 model stage 0 hands
out the base optimizer itself (optim/handed_out.py), neither class."""
import sys

import pytest
import torch

from helpers.compat_site import COMPAT
from helpers.harness import run_ranks
from helpers.models import MLP


def _stage0(stage, precision, client):
    if COMPAT not in sys.path:
        sys.path.insert(0, COMPAT)
    import deepspeed
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}}
    if precision:
        config[precision] = {"enabled": True}
    if client:
        del config["optimizer"]
    engine, opt, *_ = deepspeed.initialize(model=model, config=config,
                                           optimizer=torch.optim.AdamW(model.parameters()) if client else None)
    dtype = next(engine.module.parameters()).dtype
    engine.backward(model.loss(MLP.batch(2, torch.Generator().manual_seed(1), dtype)))
    engine.step()
    classes = (isinstance(opt, FP16_Optimizer), isinstance(opt, FP16_UnfusedOptimizer))
    try:
        masters = opt.fp32_groups_flat
        # whole (every rank the same, as stage 0 replicates), fp32, stepped, and what the model holds
        views = all(m.dtype == torch.float32 and m.numel() == g.flat.numel() and torch.equal(m.to(g.dtype), g.flat)
                    and any(m is q for pg in opt.param_groups for q in pg["params"])
                    for m, g in zip(masters, opt.flat_groups)) and len(masters) == len(opt.flat_groups) > 0
        per_param = all(torch.equal(v.flatten(), m[off:off + p.numel()]) and v.shape == p.shape
                        for m, g, vs in zip(masters, opt.flat_groups, opt.fp32_groups)
                        for p, off, v in zip(g.params, g.offsets, vs))
        views = views and per_param
        refused = ""
    except AttributeError as exc:
        views, refused = None, str(exc)
    engine.destroy()
    return classes, views, refused


@pytest.mark.parametrize("stage,precision,client,classes", [
    (0, "bf16", False, (True, False)), (0, "bf16", True, (False, True)), (0, None, False, (False, False)),
    (1, "bf16", True, (False, False))])
def test_fp16_optimizer_class_and_stage0_masters(stage, precision, client, classes):
    for found, views, refused in run_ranks(2, _stage0, stage, precision, client):
        assert found == classes
        if stage == 0 and precision:
            assert views is True
        elif stage == 0:  # over fp32 DeepSpeed hands out the base optimizer itself, which has no masters
            assert views is None and "object has no attribute 'fp32_groups_flat'" in refused
        else:
            assert "runs stage 1" in refused


def test_fp16_optimizer_classes_are_not_built_by_hand():
    if COMPAT not in sys.path:
        sys.path.insert(0, COMPAT)
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    for cls in (FP16_Optimizer, FP16_UnfusedOptimizer):
        with pytest.raises(TypeError, match="deepspeed.initialize|ZeroOptimizer"):
            cls(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
        assert not isinstance(torch.zeros(1), cls)
