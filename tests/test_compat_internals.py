"""DeepSpeed internals that its own unit tests and libraries read, on real engines (2 gloo ranks):

- engine.tput_timer: DeepSpeed's throughput timer (batch size = train_batch_size, the first 2 optimizer
  steps untimed, one line per steps_per_print steps on rank 0; timers.throughput.enabled false: off);
- engine.sparse_tensor_module_names (always empty: sparse_gradients is refused),
  engine._get_optimizer_ckpt_name (DeepSpeed's expert-parallel optimizer file name) and
  engine._change_recovery_script_permissions (executable, or a logged line where chmod fails);
- optimizer.averaged_gradients (every stage) and get_fp32_grad_partitions() (stage 3): this rank's
  averaged fp32 gradient pieces, views of what the step applies, checked against safe_get_full_grad.
"""
import logging
import math

import pytest
import torch

from helpers.harness import run_ranks
from helpers.models import MLP


def _engine(stage, gas=1, **extra):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **extra,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, opt, *_ = zero_ext.initialize(model=model, config=config)
    return engine, opt, model


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _throughput(enabled):
    engine, _, model = _engine(1, gas=2, steps_per_print=2,
                               **({} if enabled else {"timers": {"throughput": {"enabled": False}}}))
    timer = engine.tput_timer
    fresh = (timer.batch_size, timer.initialized, timer.started, timer.start_step, timer.start_time,
             timer.micro_step_count, timer.global_step_count, timer.total_elapsed_time)
    timer.stop()  # before any start: nothing happens
    after_stop = (timer.started, timer.micro_step_count, timer.global_step_count)
    lines = _Lines()
    logger = logging.getLogger("zero_ext")
    logger.addHandler(lines)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(4 * 2):  # 4 optimizer steps of 2 micro steps, each through engine.forward
            x, y = MLP.batch(2, gen)
            engine.backward((engine(x) - y).pow(2).mean())
            engine.step()
    finally:
        logger.removeHandler(lines)
        logger.setLevel(old_level)
    rate = timer.avg_samples_per_sec()
    counts = (timer.initialized, timer.micro_step_count, timer.global_step_count, timer.total_elapsed_time > 0)
    return fresh, after_stop, counts, rate, [s for s in lines.lines if "SamplesPerSec" in s]


def test_throughput_timer_counts_and_reports_as_deepspeeds():
    for rank, (fresh, after_stop, counts, rate, lines) in enumerate(run_ranks(2, _throughput, True)):
        assert fresh == (2 * 2 * 2, False, False, 2, 0, 0, 0, 0)  # micro 2 x accumulation 2 x 2 ranks
        assert after_stop == (False, 0, 0)
        assert counts == (True, 8, 4, True)
        assert math.isfinite(rate) and rate > 0
        # steps 1-2 untimed; a line every steps_per_print (2) steps once timed: step 4 only, rank 0 only
        assert len(lines) == (1 if rank == 0 else 0), lines
        assert rank or "global_step=4" in lines[0]


def test_throughput_timer_off_by_config():
    fresh, _, counts, rate, lines = run_ranks(1, _throughput, False)[0]
    assert counts == (False, 0, 0, False) and rate == float("-inf") and not lines


def _names(folder):
    import os

    engine, *_ = _engine(2)
    script = os.path.join(folder, "zero_to_fp32.py")
    with open(script, "w") as f:
        f.write("print()\n")
    os.chmod(script, 0o644)
    engine._change_recovery_script_permissions(script)
    lines = _Lines()
    logger = logging.getLogger("zero_ext")
    logger.addHandler(lines)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        engine._change_recovery_script_permissions(os.path.join(folder, "missing", "zero_to_fp32.py"))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(old_level)
    return (engine.sparse_tensor_module_names, engine._get_optimizer_ckpt_name("/ck", "t5", 3),
            oct(os.stat(script).st_mode & 0o777), lines.lines)


def test_sparse_names_file_names_and_recovery_script_permissions(tmp_path):
    sparse, name, mode, logged = run_ranks(1, _names, str(tmp_path))[0]
    assert sparse == set()
    assert name == "/ck/t5/expp_rank_3_mp_rank_00_optim_states.pt"
    assert mode == "0o744"  # the owner may execute it now
    assert len(logged) == 1 and "missing" in logged[0]  # a missing script: logged, not raised


def _gradient_views(stage):
    from zero_ext.config.errors import EngineUsageError
    from zero_ext.utils import safe_get_full_grad

    engine, opt, model = _engine(stage)
    rank = torch.distributed.get_rank()
    engine.backward(model.loss(MLP.batch(2, torch.Generator().manual_seed(10 + rank))))
    views = opt.averaged_gradients
    per_param = opt.get_fp32_grad_partitions() if stage == 3 else None
    full = {id(p): safe_get_full_grad(p).reshape(-1) for g in opt.flat_groups for p in g.params}
    ok = True
    for k, g in enumerate(opt.flat_groups):
        if stage == 3:
            for i, (p, s) in enumerate(zip(g.params, g.shards)):
                want = torch.zeros(s * g.world)
                want[:p.ds_numel] = full[id(p)]
                want = want[rank * s:(rank + 1) * s]
                ok &= torch.allclose(views[k][i], want) and per_param[k][i] is not None
                ok &= per_param[k][i].data_ptr() == views[k][i].data_ptr() == g.grad[g.offsets[i]:].data_ptr()
        else:
            for f, v in zip(g.fragments, views[k]):
                want = full[id(g.params[f.param])][f.param_offset:f.param_offset + f.length]
                ok &= torch.allclose(v, want) and v.data_ptr() == g.grad[f.part_offset:].data_ptr()
            ok &= len(views[k]) == len(g.fragments) > 0
    refused = None
    if stage != 3:
        try:
            opt.get_fp32_grad_partitions()
        except AttributeError as exc:
            refused = str(exc)
    engine.step()
    try:
        opt.averaged_gradients
        after_step = None
    except EngineUsageError as exc:
        after_step = str(exc)
    return ok, refused, after_step


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_averaged_gradients_are_this_ranks_averaged_pieces(stage):
    for ok, refused, after_step in run_ranks(2, _gradient_views, stage):
        assert ok
        assert (refused is None) == (stage == 3) and (stage == 3 or "stage 3" in refused)
        assert after_step is not None and "no gradients now" in after_step
