"""engine.coalesce_grad_reduction() (zero_ext/optim/coalesce.py): several backward passes, one reduction.

On 2 gloo ranks: the same parameters after a step as when every backward reduces on its own (stages 1-3,
offload, a leaf module), fewer gradient reductions during the backward passes at stages 2 and 3, and the
errors for a step inside the block, nesting with no_sync() and gradients read inside it."""
import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP

CHUNKS = 4


def _config(stage, **zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, **zero}}


def _train(config, coalesce, steps=2, leaf=False, count=None):
    """Params after ``steps`` steps of CHUNKS backward passes each; with ``count`` (a dict) the gradient
    reductions (zero_ext.comm reduce / all_reduce) issued during the backward passes are counted in it."""
    import contextlib

    import zero_ext
    from zero_ext import comm

    torch.manual_seed(0)
    model = MLP()
    if leaf:
        zero_ext.utils.set_z3_leaf_modules(model, [torch.nn.Linear])
    engine, *_ = zero_ext.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    originals = {name: getattr(comm, name) for name in ("reduce", "all_reduce")}

    def counting(name):
        def call(*args, **kwargs):
            if count is not None and count.get("on"):
                count[name] = count.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call

    try:
        for name in originals:
            setattr(comm, name, counting(name))
        for _ in range(steps):
            if count is not None:
                count["on"] = True
            with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
                for i in range(CHUNKS):
                    engine.set_gradient_accumulation_boundary(i == CHUNKS - 1)
                    engine.backward(engine.module.loss(MLP.batch(2, gen)))
            if count is not None:
                count["on"] = False
            engine.step()
    finally:
        for name, fn in originals.items():
            setattr(comm, name, fn)
    with zero_ext.zero.GatheredParameters(list(engine.module.parameters())):
        out = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return out


def _compare(config, leaf=False):
    ref_count, test_count = {}, {}
    ref = _train(config, coalesce=False, leaf=leaf, count=ref_count)
    test = _train(config, coalesce=True, leaf=leaf, count=test_count)
    diff = max((ref[n] - test[n]).abs().max().item() for n in ref)
    return diff, sum(v for k, v in ref_count.items() if k != "on"), sum(v for k, v in test_count.items() if k != "on")


@pytest.mark.parametrize("stage,zero", [(1, {}), (2, {}), (2, {"overlap_comm": True, "reduce_bucket_size": 300}),
                                        (2, {"offload_optimizer": {"device": "cpu"}}), (3, {}),
                                        (3, {"offload_param": {"device": "cpu"}, "reduce_bucket_size": 300})])
def test_coalesced_step_matches_per_backward_reduction(stage, zero):
    for diff, ref_n, test_n in run_ranks(2, _compare, _config(stage, **zero)):
        assert diff < 1e-6
        if stage >= 2:  # one reduction pass per step instead of one per backward
            assert 0 < test_n < ref_n, (test_n, ref_n)


def test_coalesced_leaf_module_at_stage3():
    for diff, _, _ in run_ranks(2, _compare, _config(3), leaf=True):
        assert diff < 1e-6


def _misuse(stage):
    import zero_ext

    torch.manual_seed(0)
    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(stage))
    batch = MLP.batch(2, torch.Generator().manual_seed(0))
    errors = {}

    def expect(key, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001  (the type and message are what is checked)
            errors[key] = (type(exc), str(exc))

    with engine.coalesce_grad_reduction():
        engine.backward(engine.module.loss(batch))
        expect("step", engine.step)
        # (gradient reads inside the block return this rank's own: tests/test_engine_no_sync_reads.py)
        expect("nested", lambda: engine.coalesce_grad_reduction().__enter__())
        if stage < 2:
            expect("no_sync", lambda: engine.no_sync().__enter__())
    if stage < 2:
        with engine.no_sync():
            expect("inside_no_sync", lambda: engine.coalesce_grad_reduction().__enter__())
            engine.backward(engine.module.loss(batch))
            errors["grad_in_no_sync"] = zero_ext.utils.safe_get_full_grad(engine.module.body.weight).shape
    engine.step()  # the block's gradients, applied after it
    errors["applied"] = engine.was_step_applied()
    engine.destroy()
    return errors


@pytest.mark.parametrize("stage", [1, 2])
def test_coalesce_block_misuse_errors(stage):
    out = run_ranks(1, _misuse, stage)[0]
    assert out.pop("applied") is True
    own_grad_shape = out.pop("grad_in_no_sync", None)
    for key, (kind, msg) in out.items():
        assert issubclass(kind, AssertionError), (key, kind, msg)  # DeepSpeed asserts; ours subclass it
    assert "inside no_sync context manager" in out["step"][1] and "coalesce_grad_reduction" in out["step"][1]
    assert "nested" in out["nested"][1]
    if stage < 2:
        assert "no_sync" in out["no_sync"][1] and "nested" in out["inside_no_sync"][1]
        assert own_grad_shape == (13, 13)  # (this rank's own gradient: tests/test_engine_no_sync_reads.py)
