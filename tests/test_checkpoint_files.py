"""The folders of a checkpoint: a save to an existing tag replaces it whole or not at all (also when the
process is killed midway), killed saves leave nothing behind for long, and a tag or a `latest` file can
only name a folder inside the checkpoint folder."""
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from helpers import ROOT
from helpers.harness import run_ranks
from helpers.models import MLP


def _engine():
    import zero_ext

    torch.manual_seed(0)
    return zero_ext.initialize(model=MLP(), config={"train_micro_batch_size_per_gpu": 2,
                                                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                                   "zero_optimization": {"stage": 2}})[0]


def _train(engine, seed):
    gen = torch.Generator().manual_seed(seed)
    engine.backward(engine.module.loss(MLP.batch(2, gen)))
    engine.step()


def _values(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def _failed_resave_keeps_the_old(root):
    import zero_ext.checkpoint.engine_state as ck

    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(root, tag="t")
    saved = _values(engine)
    _train(engine, 2)
    real = ck.write_torch_file

    def failing(obj, path, **kwargs):
        raise OSError(28, "No space left on device (injected)", path)

    ck.write_torch_file = failing
    try:
        engine.save_checkpoint(root, tag="t")
        error = None
    except ck.CheckpointError as exc:
        error = str(exc)
    finally:
        ck.write_torch_file = real
    _train(engine, 3)
    path, _ = engine.load_checkpoint(root, tag="t")
    kept = _same(_values(engine), saved)
    engine.save_checkpoint(root, tag="t")
    engine.wait_for_checkpoint()
    hidden = sorted(n for n in os.listdir(root) if n.startswith("."))
    engine.destroy()
    return error, os.path.basename(path), kept, hidden


def test_a_failed_save_to_an_existing_tag_keeps_the_previous_checkpoint(tmp_path):
    for error, path, kept, hidden in run_ranks(2, _failed_resave_keeps_the_old, str(tmp_path)):
        assert "nothing was published" in error and "No space left on device (injected)" in error
        assert path == "t" and kept
        assert hidden == []


SAVER = textwrap.dedent("""
    import sys, torch, zero_ext
    sys.path.insert(0, {tests!r})
    from helpers.models import MLP
    torch.manual_seed(0)
    engine = zero_ext.initialize(model=MLP(), config={{"train_micro_batch_size_per_gpu": 2,
        "optimizer": {{"type": "AdamW"}}, "zero_optimization": {{"stage": 1}}}})[0]
    with torch.no_grad():
        for p in engine.module.parameters():
            p.fill_(1.0)
    engine.save_checkpoint({root!r}, tag="t")
    print("ready", flush=True)
    k = 1
    while True:  # saves the same tag again and again, each time with every weight equal to k
        k += 1
        with torch.no_grad():
            for p in engine.module.parameters():
                p.fill_(float(k))
            for g in engine.optimizer.flat_groups:
                g.master.copy_(g.flat[g.lo:g.hi])
        engine.save_checkpoint({root!r}, tag="t")
""")


def _load_whole(root):
    import zero_ext

    torch.manual_seed(0)
    engine = zero_ext.initialize(model=MLP(), config={"train_micro_batch_size_per_gpu": 2,
                                                     "optimizer": {"type": "AdamW"},
                                                     "zero_optimization": {"stage": 1}})[0]
    engine.load_checkpoint(root, tag="t")
    values = {float(v) for p in engine.module.parameters() for v in p.detach().unique()}
    engine.destroy()
    return values


@pytest.mark.parametrize("trial", range(3))
def test_a_save_killed_at_any_moment_leaves_one_whole_checkpoint_under_the_tag(tmp_path, trial):
    root = str(tmp_path / "ckpt")
    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(tests=os.path.join(ROOT, "tests"), root=root))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(random.Random(trial).uniform(0.05, 0.6))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    values = run_ranks(1, _load_whole, root)[0]
    assert len(values) == 1  # one save's weights, all equal: never a mix of two saves


BLOCKED_PUBLISH = textwrap.dedent("""
    import os, sys, time, torch, zero_ext
    import zero_ext.checkpoint.engine_state as ck
    sys.path.insert(0, {tests!r})
    from helpers.models import MLP
    torch.manual_seed(0)
    engine = zero_ext.initialize(model=MLP(), config={{"train_micro_batch_size_per_gpu": 2,
        "optimizer": {{"type": "AdamW"}}, "zero_optimization": {{"stage": 1}}}})[0]

    def fill(k):
        with torch.no_grad():
            for p in engine.module.parameters():
                p.fill_(k)
            for g in engine.optimizer.flat_groups:
                g.master.copy_(g.flat[g.lo:g.hi])

    fill(1.0)
    engine.save_checkpoint({root!r}, tag="t")
    engine.wait_for_checkpoint()

    def stuck(path):  # the background publish's first fsync never ends: the process is killed in it
        os.write(1, b"publishing\\n")  # (one write: the main thread prints too)
        time.sleep(3600)

    ck.fsync_file = stuck
    fill(2.0)
    engine.save_checkpoint({root!r}, tag={tag!r})
    os.write(1, b"returned\\n")
    time.sleep(3600)
""")


@pytest.mark.parametrize("tag", ["t", "u"], ids=["same-tag", "new-tag"])
def test_a_save_killed_after_it_returned_but_before_its_publish_leaves_the_previous_checkpoint(tmp_path, tag):
    root = str(tmp_path / "ckpt")
    script = tmp_path / "saver.py"
    script.write_text(BLOCKED_PUBLISH.format(tests=os.path.join(ROOT, "tests"), root=root, tag=tag))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "ZERO_EXT_CHECKPOINT_PUBLISH": "background"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    said = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}  # (the two threads' order varies)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert said == {"publishing", "returned"}
    assert (tmp_path / "ckpt" / "latest").read_text() == "t"
    assert sorted(os.listdir(root)) == [f".{tag}.saving", "latest", "t", "zero_to_fp32.py"]
    assert run_ranks(1, _load_whole, root)[0] == {1.0}  # the first save, whole


def _fail_publishing_of(tag):
    """From now on, putting the tag's folder in place fails with an I/O error (rank 0 publishes)."""
    import zero_ext.checkpoint.engine_state as ck

    real = ck.publish_dir

    def failing(staging, final, aside):
        if final.endswith(tag):
            raise OSError(5, "Input/output error (injected)", final)
        return real(staging, final, aside)

    ck.publish_dir = failing


def _failed_publish(root):
    from zero_ext.checkpoint.publish import CheckpointPublishError

    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(root, tag="a")
    engine.wait_for_checkpoint()
    saved = _values(engine)
    _fail_publishing_of("b")
    _train(engine, 2)
    returned = engine.save_checkpoint(root, tag="b")  # the failure comes after it returned
    outcomes = []
    for call in (lambda: engine.save_checkpoint(root, tag="c"), lambda: engine.save_checkpoint(root, tag="c")):
        try:
            call()
            outcomes.append("ok")
        except CheckpointPublishError as exc:
            outcomes.append(str(exc))
    engine.wait_for_checkpoint()
    latest = open(os.path.join(root, "latest")).read()
    engine.load_checkpoint(root, tag="a")
    kept = _same(_values(engine), saved)
    engine.destroy()
    return returned, outcomes, latest, kept


def test_a_failed_background_publish_is_a_named_error_at_the_next_call_on_every_rank(tmp_path):
    for returned, outcomes, latest, kept in run_ranks(2, _failed_publish, str(tmp_path),
                                                      env={"ZERO_EXT_CHECKPOINT_PUBLISH": "background"}):
        assert returned is True
        assert "save_checkpoint(" in outcomes[0] and "tag='b') returned, but its checkpoint was not published" in \
            outcomes[0] and "Input/output error (injected)" in outcomes[0]
        assert outcomes[1] == "ok" and latest == "c"  # reported once; the next save works
        assert kept


def _publish_failing_on_b(root):
    from zero_ext.checkpoint.files import CheckpointError

    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(root, tag="a")
    visible = sorted(os.listdir(root)), open(os.path.join(root, "latest")).read()  # no wait: in place already
    _fail_publishing_of("b")
    _train(engine, 2)
    try:
        engine.save_checkpoint(root, tag="b")
        failed = None
    except CheckpointError as exc:
        failed = str(exc)
    after = sorted(os.listdir(root)), open(os.path.join(root, "latest")).read()
    engine.destroy()
    return visible, failed, after


def test_a_save_is_in_place_when_it_returns_and_a_failed_publish_fails_it_on_every_rank(tmp_path):
    # the default (ZERO_EXT_CHECKPOINT_PUBLISH=sync): what DeepSpeed's users read right after saving is there
    for rank, (visible, failed, after) in enumerate(run_ranks(2, _publish_failing_on_b, str(tmp_path))):
        assert visible == (["a", "latest", "zero_to_fp32.py"], "a")
        assert failed is not None and "tag='b') failed: its checkpoint was not published" in failed
        assert "Input/output error (injected)" in failed
        names, latest = after  # the previous checkpoint; rank 0 removed the staging folder before raising
        assert latest == "a" and [n for n in names if rank == 0 or n != ".b.saving"] == ["a", "latest", "zero_to_fp32.py"]


def test_temporary_files_of_dead_processes_are_reaped(tmp_path):
    from zero_ext.checkpoint.files import reap_temporary_files

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"latest.tmp.{dead.pid}", f"latest.tmp.{os.getpid()}", "notes.txt", "x.tmp.abc"):
        (tmp_path / name).write_text("x")
    reap_temporary_files(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([f"latest.tmp.{os.getpid()}", "notes.txt", "x.tmp.abc"])


def _bad_tags(root):
    from zero_ext.checkpoint.files import CheckpointError

    engine = _engine()
    _train(engine, 1)
    errors = []
    for tag in ("../outside", "/abs", "a/b", ".hidden", ".."):
        try:
            engine.save_checkpoint(root, tag=tag)
        except CheckpointError as exc:
            errors.append(str(exc))
    engine.save_checkpoint(root, tag="good")
    engine.wait_for_checkpoint()  # (`latest` is written by the save's background publish)
    for content in (os.path.join(root, "good"), "../good"):
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(content)
        try:
            engine.load_checkpoint(root)
        except CheckpointError as exc:
            errors.append(str(exc))
    engine.destroy()
    return errors, sorted(os.listdir(os.path.dirname(root)))


def test_a_tag_or_latest_cannot_name_a_folder_outside_the_checkpoint_folder(tmp_path):
    root = str(tmp_path / "ckpt")
    errors, beside = run_ranks(1, _bad_tags, root)[0]
    assert len(errors) == 7 and all("is not a plain folder name" in e for e in errors)
    assert "read from" in errors[-1] and "latest" in errors[-1]
    assert beside == ["ckpt"]  # nothing was written next to the checkpoint folder


def _replaced_aside(root):
    from zero_ext.checkpoint.files import replaced_dir

    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(root, tag="t")
    engine.wait_for_checkpoint()
    saved = _values(engine)
    os.rename(os.path.join(root, "t"), replaced_dir(root, "t"))  # as a save killed between two renames leaves it
    _train(engine, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(root, tag="t")
    engine.destroy()
    return _same(_values(engine), saved), [str(w.message) for w in caught]


def test_a_tag_left_aside_by_a_killed_fallback_swap_is_still_loaded(tmp_path):
    same, warned = run_ranks(1, _replaced_aside, str(tmp_path))[0]
    assert same and any("holds the checkpoint a killed save was replacing" in w for w in warned)


def _damaged_shard(root):
    import zero_ext.checkpoint.engine_state as ck
    from zero_ext.checkpoint.files import CheckpointError

    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(root, tag="t")
    engine.wait_for_checkpoint()
    if torch.distributed.get_rank() == 0:
        path = os.path.join(root, "t", ck.optim_file(1, False))
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(bytes(data))
    torch.distributed.barrier()
    try:
        engine.load_checkpoint(root, tag="t")
        verdict = None
    except CheckpointError as exc:
        verdict = str(exc)
    engine.destroy()
    return verdict


def test_a_damaged_shard_is_the_same_named_error_on_every_rank(tmp_path):
    verdicts = run_ranks(2, _damaged_shard, str(tmp_path))
    assert verdicts[0] == verdicts[1]
    assert verdicts[0].startswith("rank 1: ")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is corrupted" in verdicts[0]


def _enum_in_config(root):
    import zero_ext
    from zero_ext.checkpoint.engine_state import MODEL_FILE

    def build():
        torch.manual_seed(0)
        return zero_ext.initialize(model=MLP(), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": zero_ext.OffloadDeviceEnum.cpu}}})[0]

    engine = build()
    _train(engine, 1)
    engine.save_checkpoint(root, tag="t")
    saved = _values(engine)
    engine.destroy()
    state = torch.load(os.path.join(root, "t", MODEL_FILE), weights_only=True)  # anyone's loader
    again = build()
    again.load_checkpoint(root, tag="t")
    same = _same(_values(again), saved)
    again.destroy()
    return state["ds_config"]["zero_optimization"]["offload_optimizer"]["device"], same


def test_a_config_holding_enums_is_saved_as_plain_data_and_loads_back(tmp_path):
    device, same = run_ranks(1, _enum_in_config, str(tmp_path))[0]
    assert device == "cpu" and same
