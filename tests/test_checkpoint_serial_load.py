"""zero_optimization.pipeline_loading_checkpoint: the ranks of a host load a stage-3 checkpoint one after
another (local-rank order), with the same result as a load that runs on every rank at once."""
import time

import pytest
import torch

from helpers.engine import fp32_masters, full_params, optimizer_state
from helpers.harness import RankFailed, run_ranks
from helpers.models import MLP


def _config(serial):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "pipeline_loading_checkpoint": serial}}


def _engine(serial, seed):
    import zero_ext

    torch.manual_seed(seed)
    engine, *_ = zero_ext.initialize(model=MLP(), config=_config(serial))
    return engine


def _state(engine):
    return {"params": full_params(engine), "masters": fp32_masters(engine),
            "exp_avg": optimizer_state(engine, "exp_avg"), "steps": engine.global_steps}


def _save(tmp):
    engine = _engine(False, 0)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(3):
        engine.backward(engine.module.loss(MLP.batch(2, gen)))
        engine.step()
    engine.save_checkpoint(tmp, tag="t")
    return _state(engine)


def _load(tmp, serial):
    from zero_ext.checkpoint import engine_state

    spans, read = [], engine_state.verified_load  # (observed, not replaced: when this rank reads files)

    def timed(*args, **kwargs):
        start = time.monotonic()
        out = read(*args, **kwargs)
        spans.append((start, time.monotonic()))
        return out

    engine_state.verified_load = timed
    try:
        engine = _engine(serial, 1)  # other initial weights: everything must come from the checkpoint
        engine.load_checkpoint(tmp, tag="t")
    finally:
        engine_state.verified_load = read
    return _state(engine), (min(s for s, _ in spans), max(e for _, e in spans))


def _same(a, b):
    return all(torch.equal(a[k][n], b[k][n]) for k in ("params", "masters", "exp_avg") for n in a[k]) and \
        a["steps"] == b["steps"]


def test_serial_load_restores_what_was_saved_one_rank_at_a_time(tmp_path):
    saved = run_ranks(3, _save, str(tmp_path))
    loaded = run_ranks(3, _load, str(tmp_path), True)
    assert all(_same(state, saved[0]) for state, _ in loaded)
    windows = sorted(w for _, w in loaded)  # each rank's file reads: no two ranks' overlap
    assert all(earlier[1] <= later[0] for earlier, later in zip(windows, windows[1:]))
    assert [w for _, w in loaded] == windows  # in local-rank order


def test_parallel_load_gives_the_same_state(tmp_path):
    saved = run_ranks(2, _save, str(tmp_path))
    assert all(_same(state, saved[0]) for state, _ in run_ranks(2, _load, str(tmp_path), False))


def test_a_damaged_file_fails_every_rank_instead_of_hanging(tmp_path):
    run_ranks(2, _save, str(tmp_path))
    (tmp_path / "t" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"broken")
    with pytest.raises(RankFailed, match="rank 0: .*zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        run_ranks(2, _load, str(tmp_path), True, timeout=60)


def test_needs_stage_3():
    from zero_ext.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="only supported with ZeRO stage 3"):
        load_config({"zero_optimization": {"stage": 2, "pipeline_loading_checkpoint": True}})
