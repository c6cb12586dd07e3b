"""The memory estimators (zero_ext/utils/estimate.py, at DeepSpeed's stage_1_and_2 / stage3 paths): their
table, and their bytes against memory_breakdown() of real engines on 1 and 2 gloo ranks; `zero-ext estimate`."""
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT
from helpers.harness import run_ranks

WIDTH, DEPTH = 64, 16  # 16 equal layers: the largest one is a small part of the model


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.float().sum()


def _breakdown(stage, offload_optimizer, offload_param):
    import zero_ext

    torch.manual_seed(0)
    zo = {"stage": stage, "reduce_bucket_size": 100, "overlap_comm": False}
    if stage == 3:
        zo["stage3_param_persistence_threshold"] = 0  # no parameter held whole: all of them partitioned
    if offload_optimizer:
        zo["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zo["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": zo,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zero_ext.initialize(model=Stack(), config=config)
    for _ in range(2):  # measured after the second backward: Adam's state exists (made at the first
        loss = engine(torch.randn(2, WIDTH).bfloat16())  # step) and so do the gradients (ZeRO-2 frees
        engine.backward(loss)  # its fp32 partition after each step): the peak the estimators count
        table = engine.memory_breakdown()
        engine.step()
    return table


STATES = ("params", "grads", "fp32_master", "fp32_grads", "optimizer_state")  # what the estimators count


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage,offload_optimizer,offload_param",
                         [(2, False, False), (2, True, False), (3, False, False), (3, True, False), (3, True, True)])
def test_estimate_matches_memory_breakdown(world, stage, offload_optimizer, offload_param):
    from zero_ext.utils.estimate import estimate, model_to_params

    total, largest = model_to_params(Stack())
    assert (total, largest) == (DEPTH * (WIDTH * WIDTH + WIDTH), WIDTH * WIDTH + WIDTH)
    measured = run_ranks(world, _breakdown, stage, offload_optimizer, offload_param, timeout=90)[0]
    acc = sum(measured[k]["accelerator"] for k in STATES)
    host = sum(measured[k]["host"] for k in STATES)
    e = estimate(stage, total, largest, world, offload_optimizer, offload_param)
    # after backward no layer is gathered, so the working set W is compared on its own: 4 bytes a parameter
    assert e.working_set == (4 * largest if stage == 3 else 0)
    assert e.accelerator_states == pytest.approx(acc, rel=0.05, abs=0)
    assert e.host_states == pytest.approx(host, rel=0.05, abs=0)
    if not offload_optimizer:  # the printed per-GPU number, working set included, within 5% as well (with
        assert e.accelerator == pytest.approx(acc, rel=0.05)  # offload, W is most of a tiny remainder)


def test_deepspeed_functions_print_the_table(capsys):
    from zero_ext.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                              estimate_zero3_model_states_mem_needs_all_live)
    from zero_ext.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                     estimate_zero2_model_states_mem_needs_all_cold)

    estimate_zero2_model_states_mem_needs_all_cold(total_params=2 ** 30, num_gpus_per_node=4, num_nodes=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == ["Estimated memory needed for params, optim states and gradients for a:",
                         "HW: Setup with 2 nodes, 4 GPUs per node.", "SW: Model with 1073M total params.",
                         "  per CPU  |  per GPU |   Options"]
    # 2^30 params over 8 ranks: GPU 2 + 16/8 = 4 GiB; offloaded 2 GiB, host per node max(16/8, 4 load) * 4 * 1.5
    assert lines[4:] == ["   24.00GB |   2.00GB | offload_optimizer=cpu ",
                         "   24.00GB |   4.00GB | offload_optimizer=none"]
    assert estimate_zero2_model_states_mem_needs(2 ** 30, 8, 1, cpu_offload=False,
                                                 additional_buffer_factor=1.0) == (32 * 2 ** 30, 4 * 2 ** 30)
    cpu, gpu, working = estimate_zero3_model_states_mem_needs(2 ** 30, 2 ** 20, 8, 1, True, False, True, 1.0)
    assert (cpu, gpu, working) == (8 * 16 * 2 ** 30 // 8, 2 * 2 ** 30 // 8 + 4 * 2 ** 20, 4 * 2 ** 20)

    estimate_zero3_model_states_mem_needs_all_live(Stack(), num_gpus_per_node=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "SW: Model with 0M total params, 0M largest layer params."
    assert [l.split("| ", 2)[2] for l in lines[4:]] == [
        f"offload_param={p}, offload_optimizer={o}, zero_init={z}"
        for p, o in (("cpu ", "cpu "), ("none", "cpu "), ("none", "none")) for z in (1, 0)]


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "zero_ext.launcher", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env)


def test_cli_prints_both_tables_and_plots_or_says_how_to_get_matplotlib(tmp_path):
    done = _cli("estimate", "--params", "7e9", "--largest_layer_params", "2e8", "--num_gpus", "8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("  per CPU  |  per GPU |   Options") == 2 and "7000M total params, 200M largest" in done.stdout
    png = tmp_path / "mem.png"
    plotted = _cli("estimate", "--params", "1e9", "--plot", str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plotted.returncode != 0 and "pip install matplotlib" in plotted.stderr
    else:
        assert plotted.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_model_is_built_on_meta(tmp_path):
    (tmp_path / "mymodels.py").write_text("import torch\n"
                                          "def big():\n    return torch.nn.Sequential(torch.nn.Linear(4096, 4096),"
                                          " torch.nn.Linear(4096, 1024))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    done = subprocess.run([sys.executable, "-m", "zero_ext.launcher", "estimate", "--model", "mymodels:big",
                           "--stage", "3"], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "SW: Model with 20M total params, 16M largest layer params." in done.stdout
    assert "offload_optimizer=none" in done.stdout and "ZeRO-2" not in done.stdout
