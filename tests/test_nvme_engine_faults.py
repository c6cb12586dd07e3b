"""The NVMe drive fills up during a step: a named error at once, then the engine refuses to go on (part of
that step's state exists nowhere) and says what to do; after freeing space a new engine loads the last
checkpoint and trains. Swap files are reserved (fallocate) when they are made, so a drive that fills
up after initialize cannot hurt the in-place writes of a step; the fault is injected the way a lost
reservation shows itself: a swap file's descriptor is pointed at a sparse file of its size on a full
tmpfs, whose next write the kernel refuses with ENOSPC."""
import errno
import os
import time

import pytest
import torch

from helpers.fs import mount
from helpers.harness import run_ranks
from helpers.models import TinyGPT


def _config(stage, swap):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "sub_group_size": 3000,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": swap}}}


def _fill(folder):
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def _full_during_a_step(stage, swap, full, ckpt):
    import zero_ext
    from zero_ext.nvme.aio import AioError

    torch.manual_seed(0)
    engine = zero_ext.initialize(model=TinyGPT(), config=_config(stage, swap))[0]
    gen = torch.Generator().manual_seed(1)

    def step(e):
        loss = e.module.loss(TinyGPT.batch(2, gen))
        e.backward(loss)
        e.step()
        return loss.item()

    step(engine)
    engine.save_checkpoint(ckpt, tag="last")
    store = engine.optimizer.nvme
    victim = store.swapper._files[sorted(store.swapper._files)[1]]
    fd = os.open(os.path.join(full, "victim"), os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, victim.size())  # the same size, no blocks: reads give zeros, writes need space
    _fill(full)
    os.dup2(fd, victim.fd)
    os.close(fd)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    start = time.monotonic()
    try:
        step(engine)
        first = "no error"
    except AioError as exc:
        first = (exc.errno, str(exc))
    seconds = time.monotonic() - start
    unchanged = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    later = []
    for call in (lambda: step(engine), lambda: engine(torch.zeros(1, 9, dtype=torch.long)),
                 lambda: engine.save_checkpoint(ckpt, tag="broken")):
        try:
            call()
            later.append("no error")
        except RuntimeError as exc:
            later.append(str(exc))
    engine.destroy()
    os.unlink(os.path.join(full, "filler"))  # space freed: a new engine resumes from the checkpoint
    fresh = zero_ext.initialize(model=TinyGPT(), config=_config(stage, swap))[0]
    fresh.load_checkpoint(ckpt, tag="last")
    resumed = [step(fresh) for _ in range(2)]
    fresh.destroy()
    return first, seconds, unchanged, later, resumed, sorted(os.listdir(ckpt))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_drive_full_during_a_step_is_named_and_the_engine_stops(stage, tmp_path, mounts):
    full = mount(tmp_path, "tmpfs", "size=64k")
    mounts.append(full)
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    first, seconds, unchanged, later, resumed, saved = run_ranks(1, _full_during_a_step, stage, str(swap), str(full),
                                                                 str(ckpt), timeout=120)[0]
    assert first[0] == errno.ENOSPC and "No space left on device" in first[1] and ".swp" in first[1], first
    assert seconds < 10
    if stage == 3:  # the pieces are written by the step's end only: the model in memory is as before
        assert unchanged
    for message in later:  # step, forward, save: the state is incomplete, nothing may use it
        assert "this engine cannot continue: step 2 could not write its state to NVMe" in message, message
        assert "build a new engine and load the last checkpoint" in message
    assert all(loss == loss for loss in resumed) and saved == ["last", "latest", "zero_to_fp32.py"]
