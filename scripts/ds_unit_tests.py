"""DeepSpeed's own unit tests against this checkout's `deepspeed` compatibility package (compat/), file
by file, with a table of counts: how issue 20's measurement is taken, so anyone can repeat it.

    python scripts/ds_unit_tests.py --tests ~/DeepSpeed/tests            # compat/ over zero_ext
    python scripts/ds_unit_tests.py --tests ~/DeepSpeed/tests --wide     # and the wider set
    python scripts/ds_unit_tests.py --tests ~/DeepSpeed/tests --ranks 4 \
        unit/v1/moe/test_moe.py unit/checkpoint/test_moe_checkpoint.py    # MoE: most want 4 ranks
    python scripts/ds_unit_tests.py --tests ~/DeepSpeed/tests --reference /venv/bin/python

``--tests`` is the ``tests`` folder of a DeepSpeed checkout (its conftest and unit/common.py harness
run unchanged; nothing of it is copied here). Each file runs in its own pytest process on the CPU:
``LOCAL_SIZE`` (default 2) makes the CPU accelerator report that many devices, DeepSpeed's as ours,
so the harness's 2-rank DistributedTests spawn gloo ranks instead of skipping; tests that want more
ranks than that still skip. ``--reference PYTHON`` runs the same files on the real DeepSpeed installed
for that interpreter (``DS_ACCELERATOR=cpu``; its CPU accelerator falls back to gloo without oneCCL),
which tells a test that cannot run on a CPU from one that zero_ext fails. Logs (``pytest -rA``: every
test's outcome and the reason of each skip) go to --logs.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The files of issue 20's measurement: ZeRO, config and checkpoint tests of DeepSpeed's tests/unit.
FILES = [
    "unit/runtime/test_ds_config_dict.py", "unit/runtime/test_ds_config_model.py",
    "unit/checkpoint/test_zero_optimizer.py", "unit/checkpoint/test_lr_scheduler.py",
    "unit/checkpoint/test_other_optimizer.py", "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/v1/zero/test_zero.py", "unit/v1/zero/test_offload_states.py",
] + [f"unit/runtime/zero/{name}.py" for name in (
    "test_zero_config", "test_zero_context", "test_zero_context_ancestry", "test_zero_context_return",
    "test_zero_dynamic_class", "test_zero_hook_attribute_delegation", "test_zero_late_module_attach",
    "test_zero_leaf_module", "test_zero_linear_direct_init", "test_zero_nesting_init",
    "test_zero_tensor_fragment", "test_zero_tiled", "test_zeropp", "test_unwrap_model",
    "test_ignore_unused_parameters", "test_zero_offloadpp", "test_nvme_checkpointing", "test_zero_grad_clip",
    "test_zero_allreduce_fetch_params", "test_zero_autocast_mixed_dtype")]

# The wider set measured since session 11 (--wide): ZeRO lifecycle, precision, no_sync, several models,
# activation checkpointing and torch.autocast files.
WIDE = [f"unit/v1/zero/{name}.py" for name in (
    "test_overlap_comm_record_stream", "test_stage2_flatten_on_gpu", "test_zero2_offload_multi_backward",
    "test_zero_activation_checkpoint_lifecycle", "test_zero_coalesce_grad_reduction",
    "test_zero_cpu_offload_grad_accum", "test_zero_functorch_linear", "test_zero_hook_count_regression",
    "test_zero_init_pg_contradiction", "test_zero_torch_func", "test_zero_autocast")] + [
    f"unit/runtime/{name}.py" for name in (
        "test_ds_initialize", "test_no_sync_ctxt", "test_multiple_models", "test_multi_output_model",
        "test_precision_config_dynamic_scale", "test_precision_config_loss_scale", "test_runtime_utils",
        "test_autocast", "half_precision/test_fp16", "half_precision/test_dynamic_loss_scale",
        "half_precision/test_zero_optim_overflow", "zero/test_zero_autocast_mixed_dtype",
        "activation_checkpointing/test_activation_checkpointing",
        "activation_checkpointing/test_activation_checkpointing_non_reentrant",
        "activation_checkpointing/test_offload_activations")] + [
    "unit/v1/test_engine_log_level.py", "unit/v1/half_precision/test_with_autocast.py"]

# Tests that expect DeepSpeed to refuse what zero_ext supports (documented differences, docs/api.md). They
# are left out (--deselect) and counted in the "differ" column: run, their pytest.raises fails inside a
# spawned rank with pytest's Failed, a BaseException that DeepSpeed's pool harness never hands back, so the
# harness waits DS_UNITTEST_TIMEOUT and then exits pytest, dropping the rest of the file.
DIFFERENCES = {
    "unit/v1/zero/test_zero_torch_func.py::TestZero0DirectBackwardStillRaises::"
    "test_direct_backward_raises_without_functorch": "loss.backward() on the engine's output works at stage 0 too",
    "unit/v1/zero/test_zero_coalesce_grad_reduction.py::TestCoalesceGradAccumDtype::"
    "test_zero1_no_offload_uses_bf16_optimizer": "coalesce_grad_reduction works with bf16 + grad_accum_dtype fp32",
    "unit/runtime/zero/test_zero_leaf_module.py::TestSetZ3LeafModule::test_no_grad_input_error":
        "a ZeRO-3 leaf module whose inputs need no grad works",
}

OUTCOMES = ("passed", "failed", "error", "skipped")


def counts(summary: str) -> dict:
    """pytest's last line ('3 passed, 1 failed, 2 skipped in 4.5s') as {outcome: n}."""
    found = {k: 0 for k in OUTCOMES}
    for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary):
        found["error" if word.startswith("error") else word] += int(n)
    return found


def run_file(args, path: str) -> dict:
    env = dict(os.environ, LOCAL_SIZE=str(args.ranks))
    if args.reference:
        env["DS_ACCELERATOR"] = "cpu"
        env.pop("PYTHONPATH", None)
    else:  # this checkout's compat/ and zero_ext before anything installed
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "compat"), ROOT, env.get("PYTHONPATH", "")])
    log = os.path.join(args.logs, path.replace("/", "_") + ".log")
    cmd = [args.reference or sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
           "--color=no", path]
    differ = [t for t in DIFFERENCES if t.startswith(path + "::")] if not args.reference else []
    for test in differ:
        cmd += ["--deselect", test]
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            subprocess.run(cmd, cwd=args.tests, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
    lines = [ln for ln in open(log, errors="replace").read().splitlines() if ln.strip()]
    row = counts(lines[-1] if lines and not timed_out else "")
    row.update(seconds=time.monotonic() - start, timed_out=timed_out, log=log, differ=len(differ))
    return row


def outside_the_checkout(tests: str) -> str:
    """DeepSpeed's conftest puts the folder above ``tests`` first on sys.path: in a checkout that is its own
    ``deepspeed/`` source, which would then be tested instead of compat/ (or of the installed DeepSpeed
    with --reference). Such a folder is copied out
    (once, to /tmp/ds_unit_tests/tests) and the copy is run."""
    tests = os.path.abspath(os.path.expanduser(tests))
    if not os.path.isdir(os.path.join(os.path.dirname(tests), "deepspeed")):
        return tests
    copy = os.path.join(tempfile.gettempdir(), "ds_unit_tests", "tests")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(tests, copy)
    return copy


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", required=True, help="a DeepSpeed checkout's tests/ folder")
    p.add_argument("--reference", metavar="PYTHON", help="run on the real DeepSpeed of this interpreter")
    p.add_argument("--ranks", type=int, default=2, help="LOCAL_SIZE: CPU devices the accelerator reports")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per file")
    p.add_argument("--logs", default="/tmp/ds_unit_logs")
    p.add_argument("--wide", action="store_true", help=f"also the {len(WIDE)} files of the wider set")
    p.add_argument("files", nargs="*", help=f"test files below --tests (default: the {len(FILES)} of issue 20)")
    args = p.parse_args()
    args.tests = outside_the_checkout(args.tests)
    os.makedirs(args.logs, exist_ok=True)
    total = {k: 0 for k in OUTCOMES + ("differ",)}
    print(f"{'file':58} " + " ".join(f"{k:>7}" for k in OUTCOMES + ("differ",)) + f" {'s':>6}")
    for path in args.files or FILES + (WIDE if args.wide else []):
        row = run_file(args, path)
        for k in OUTCOMES + ("differ",):
            total[k] += row[k]
        note = "  TIMED OUT" if row["timed_out"] else ""
        cells = " ".join(f"{row[k]:7d}" for k in OUTCOMES + ("differ",))
        print(f"{path:58} {cells} {row['seconds']:6.0f}{note}", flush=True)
    print(f"{'total':58} " + " ".join(f"{total[k]:7d}" for k in OUTCOMES + ("differ",)))
    print(f"logs: {args.logs}")


if __name__ == "__main__":
    main()
