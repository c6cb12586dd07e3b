"""The NVMe drive fills up during a step with offload_param.device = "nvme" (stage 3): a named error at
once, then the engine refuses to go on (the step wrote part of the new 16-bit pieces into their swap
files in place, which cannot be undone) and says what to do; after freeing space a new engine loads
the last checkpoint and trains. (With the optimizer alone on NVMe the step is undone instead:
test_nvme_step_rollback.py.) Swap files are reserved (fallocate) when they are made, so a drive that
fills up after initialize cannot hurt the writes of a step; the fault is injected the way a lost
reservation shows itself (helpers/fs.lose_reservation: a sparse file on a full tmpfs)."""
import errno
import os
import time

import torch

from helpers.fs import lose_reservation, mount
from helpers.harness import run_ranks
from helpers.models import TinyGPT


def _config(stage, swap):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "sub_group_size": 3000,
                                  "offload_param": {"device": "nvme", "nvme_path": swap},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": swap}}}


def _full_during_a_step(stage, swap, full, ckpt):
    import zero_ext
    from zero_ext.optim.nvme_step import NVMeStepError

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
    victim = store._groups[store.keys()[1]]  # the second sub-group: the first one's pieces are written by then
    lose_reservation(store.swapper._files[victim.spare], full)
    start = time.monotonic()
    try:
        step(engine)
        first = "no error"
    except NVMeStepError as exc:
        first = (exc.errno, exc.rolled_back, str(exc), str(exc.__cause__))
    seconds = time.monotonic() - start
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
    return first, seconds, later, resumed, sorted(os.listdir(ckpt))


def test_a_drive_full_during_a_step_with_offload_param_nvme_is_named_and_the_engine_stops(tmp_path, mounts):
    stage = 3  # (offload_param nvme is stage 3's)
    full = mount(tmp_path, "tmpfs", "size=64k")
    mounts.append(full)
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    first, seconds, later, resumed, saved = run_ranks(1, _full_during_a_step, stage, str(swap), str(full),
                                                      str(ckpt), timeout=120)[0]
    assert first[0] == errno.ENOSPC and first[1] is False and "cannot be undone" in first[2], first
    assert "No space left on device" in first[3] and ".swp" in first[3], first  # the cause names the file
    assert seconds < 10
    for message in later:  # step, forward, save: the state is incomplete, nothing may use it
        assert "this engine cannot continue: step 2 could not write its state to NVMe" in message, message
        assert "build a new engine and load the last checkpoint" in message
    assert all(loss == loss for loss in resumed) and saved == ["last", "latest", "zero_to_fp32.py"]
