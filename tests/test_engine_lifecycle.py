"""Forward-only engines, no_sync, set_train_batch_size, add_config_arguments and the launcher."""
import argparse
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import ROOT
from helpers.harness import RankFailed, run_ranks
from helpers.models import MLP



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
    assert "inside no_sync context manager (here engine.no_sync())" in inside and steps == 1
    with pytest.raises(RankFailed, match="no_sync context manager is incompatible with ZeRO stage 2"):
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


# -- destroy(): nothing left behind ------------------------------------------------------------------------

def _hooks_on(model):
    """Every hook a module or parameter can carry, counted."""
    count = 0
    for m in model.modules():
        count += len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
        count += len(getattr(m, "_backward_pre_hooks", {}))
    for p in model.parameters():
        count += len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return count


def _create_destroy_cycles(stage, offload, cycles):
    """Builds, trains and destroys an engine `cycles` times; returns what each cycle left behind."""
    import gc
    import tempfile
    import weakref

    import torch.nn.functional as F

    import zero_ext

    patched = (F.linear, torch.Tensor.__torch_function__, torch.nn.Module.apply, torch.empty, torch.zeros)
    rank = torch.distributed.get_rank()
    out = []
    for cycle in range(cycles):
        torch.manual_seed(0)
        model = MLP()
        zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
        if offload == "cpu":
            zero["offload_optimizer"] = {"device": "cpu"}
        elif offload == "nvme":
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": tempfile.gettempdir()}
        engine, handed, _, _ = zero_ext.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
        opt = engine.zero_optimizer  # (at stage 0 over fp32 ``handed`` is its base)
        x, y = MLP.batch(2, torch.Generator().manual_seed(rank))
        engine.backward(engine.module.loss((x, y)))
        engine.step()
        swap_dir = opt.nvme.swapper.dir.path if opt.nvme is not None else None
        watched = [weakref.ref(engine), weakref.ref(opt), weakref.ref(opt.optimizer)]
        watched += [weakref.ref(g.grad) for g in opt.flat_groups if g.grad is not None]  # (stage 2 frees it at step)
        watched += [weakref.ref(t) for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        # a master that is not the parameters' own storage (bf16, offload) must go too
        watched += [weakref.ref(g.master) for g in opt.flat_groups if g.master.data_ptr() != g.flat.data_ptr()]
        engine.destroy()
        try:
            engine.step()
        except RuntimeError as exc:
            refused = "was destroyed" in str(exc)
        with zero_ext.zero.GatheredParameters(list(model.parameters())):  # (stage 3: still partitioned)
            plain = model(x)  # the module runs without the engine
        del engine, opt, handed  # (what the script holds; the base optimizer too)
        gc.collect()
        out.append({"alive": sum(r() is not None for r in watched), "hooks": _hooks_on(model), "refused": refused,
                    "swap_dir_left": swap_dir is not None and os.path.exists(swap_dir),
                    "finite": bool(torch.isfinite(plain).all())})
    unpatched = patched == (F.linear, torch.Tensor.__torch_function__, torch.nn.Module.apply, torch.empty,
                            torch.zeros)
    return out, unpatched


@pytest.mark.parametrize("stage,offload", [(0, None), (1, "cpu"), (2, None), (2, "nvme"), (3, None), (3, "cpu")])
def test_destroy_leaves_no_hook_no_patch_no_swap_file_and_frees_the_engine(stage, offload):
    for cycles, unpatched in run_ranks(2, _create_destroy_cycles, stage, offload, 3):
        assert unpatched
        for c in cycles:
            assert c == {"alive": 0, "hooks": 0, "refused": True, "swap_dir_left": False, "finite": True}, c


def _destroy_then_unpartition():
    import zero_ext
    from zero_ext.zero import is_zero_param

    torch.manual_seed(0)
    model = MLP()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zero_ext.initialize(model=model, config=config)
    x, y = MLP.batch(2, torch.Generator().manual_seed(torch.distributed.get_rank()))
    engine.backward(engine.module.loss((x, y)))
    engine.step()
    with zero_ext.zero.GatheredParameters(list(model.parameters())):
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    zero_ext.zero.unpartition(model)
    plain = not any(is_zero_param(p) or hasattr(p, "ds_tensor") for p in model.parameters())
    same = all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    out = model(x)  # a plain module: no gathering needed
    # and it can start over under another stage
    engine2, _, _, _ = zero_ext.initialize(model=model, config={**config, "zero_optimization": {"stage": 2}})
    engine2.backward(engine2.module.loss((x, y)))
    engine2.step()
    engine2.destroy()
    return plain, same, tuple(out.shape)


def test_unpartition_after_destroy_gives_a_plain_module_with_the_trained_weights():
    for plain, same, shape in run_ranks(2, _destroy_then_unpartition):
        assert plain and same and shape == (2, 5)
