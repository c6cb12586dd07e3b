"""Forward-only engines, no_sync, set_train_batch_size, add_config_arguments and the launcher."""
import argparse
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from harness import RankFailed, run_ranks
from models import MLP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _forward_only(stage):
    import zero_ext

    torch.manual_seed(0)
    model = MLP()
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    engine, opt, _, sched = zero_ext.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2,
                                                                      "zero_optimization": {"stage": stage}})
    x = torch.randn(2, 7, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = engine(x)
    errors = []
    for call in (lambda: engine.backward(out.sum()), lambda: engine.step()):
        try:
            call()
        except RuntimeError as exc:
            errors.append(str(exc))
    engine.destroy()
    return opt, sched, torch.allclose(out, ref(x)), errors


@pytest.mark.parametrize("stage", [0, 3])
def test_an_engine_without_optimizer_runs_forward_only(stage):
    for opt, sched, same, errors in run_ranks(2, _forward_only, stage):
        assert opt is None and sched is None and same
        assert len(errors) == 2 and all("has no optimizer" in e for e in errors)


def _no_sync(stage):
    import zero_ext

    torch.manual_seed(0)
    engine = zero_ext.initialize(model=MLP(), config={"train_micro_batch_size_per_gpu": 2,
                                                      "gradient_accumulation_steps": 2,
                                                      "optimizer": {"type": "AdamW"},
                                                      "zero_optimization": {"stage": stage}})[0]
    gen = torch.Generator().manual_seed(0)
    with engine.no_sync():
        engine.backward(engine.module.loss(MLP.batch(2, gen)))
        try:
            engine.step()
        except RuntimeError as exc:
            inside = str(exc)
    engine.step()
    engine.backward(engine.module.loss(MLP.batch(2, gen)))
    engine.step()
    return inside, engine.global_steps


def test_no_sync_under_stage_1_and_its_refusal_under_stage_2():
    inside, steps = run_ranks(2, _no_sync, 1)[0]
    assert "inside engine.no_sync()" in inside and steps == 1
    with pytest.raises(RankFailed, match="no_sync\\(\\) is incompatible with ZeRO stage 2"):
        run_ranks(2, _no_sync, 2)


def _batch_size():
    import zero_ext

    engine = zero_ext.initialize(model=MLP(), config={"train_micro_batch_size_per_gpu": 2,
                                                      "optimizer": {"type": "AdamW"}})[0]
    engine.set_train_batch_size(8 * torch.distributed.get_world_size())
    out = engine.get_batch_info()
    try:
        engine.set_train_batch_size(3)
    except ValueError as exc:
        return out, str(exc)


def test_set_train_batch_size_changes_the_accumulation_steps():
    (info, err), _ = run_ranks(2, _batch_size)
    assert info == (16, 2, 4) and "not a multiple of micro batch 2 x 2 ranks" in err


def test_add_config_arguments_parses_deepspeed_flags():
    import zero_ext

    parser = zero_ext.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json" and not args.deepscale


def test_launcher_starts_ranks_with_local_rank_and_stops_the_rest_on_failure(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import argparse, os, sys, time
        import torch.distributed as dist
        import zero_ext
        p = zero_ext.add_config_arguments(argparse.ArgumentParser())
        p.add_argument("--local_rank", type=int)
        p.add_argument("--fail", action="store_true")
        a = p.parse_args()
        zero_ext.init_distributed(verbose=False)
        assert a.local_rank == int(os.environ["LOCAL_RANK"]) == dist.get_rank()
        print(f"rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
        if a.fail and dist.get_rank() == 1:
            sys.exit(3)
        if a.fail:
            time.sleep(60)  # rank 0 would wait; the launcher stops it
    """))
    env = {**os.environ, "PYTHONPATH": ROOT}
    ok = subprocess.run([sys.executable, "-m", "zero_ext.launcher", "--num_procs", "2", str(script), "--deepspeed"],
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    # both ranks share the pipe: their lines may interleave
    assert sorted(re.findall(r"rank (\d) of 2", ok.stdout)) == ["0", "1"], ok.stdout
    bad = subprocess.run([sys.executable, "-m", "zero_ext.launcher", "--num_procs", "2", str(script), "--fail"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 3
