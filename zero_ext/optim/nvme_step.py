"""The optimizer step with ``offload_optimizer.device = "nvme"``: all or nothing, on every rank.

[Note: NVMe step transaction] The step streams each sub-group's fp32 master and optimizer state in,
updates it and writes it back. A write can fail in the middle (a full drive: a quota, a file system
that lost its reservation; an I/O error), after some sub-groups were written and before others were.
So that such a step leaves nothing half done:
1. the store writes every sub-group into its spare file ([Note: spare slots], nvme/groups.py) inside a
   transaction: the files holding the state from before the step are not touched;
2. the new 16-bit values go into a host staging buffer of each group, not into the model (with
   ``offload_param.device = "nvme"`` into the group's pieces, whose store writes them to their spare
   files in a transaction of its own);
3. when the loop ends (or fails) the ranks agree: every rank's outcome (0, or the errno of its failed
   I/O) is summed in one all-reduce of ``world`` integers over every rank of the job;
4. all succeeded: the stores commit (the spare files become the good ones), the step counters move on
   and the staged values go into the model. One failed: every rank rolls back (the buffers and cached
   pieces with new values are dropped, the step counters restored) and raises the same
   ``NVMeStepError``. The model, the optimizer state in memory and on NVMe and the gradients are as
   before ``step()``, so calling ``step()`` again after space was freed takes the step that failed,
   bit for bit.
"""
import contextlib
import errno
import os
from typing import Dict, List, Optional

import torch

from .. import comm
from ..nvme.aio import AioError
from ..zero import collectives

NOT_IO = -1  # a rank's failure that is not an OSError (its own exception is raised there)


class NVMeStepError(AioError):
    """An optimizer step could not write its state to NVMe on some rank. Raised on every rank with
    the same message; ``errno`` is the first failed rank's, ``failed`` maps rank -> errno (-1: not an
    I/O error). The step was undone on every rank (``rolled_back``): nothing changed."""

    rolled_back = True  # (the engine goes on after it; an NVMe error without it stops the engine)

    def __init__(self, err: int, message: str, failed: Dict[int, int]):
        super().__init__(err, message)
        self.failed = failed


def nvme_step(opt, combined: float, streamed: List, step_slice, step_group, pipeline=(False, False)) -> None:
    """Steps the store groups ``streamed`` (group indices, or (group, slice) pairs) as one transaction
    across the ranks (see the Note): ``step_slice(k, j, combined, staged)`` and ``step_group(k, combined,
    staged)`` update one and write the new parameters into ``staged`` (None: into the model at once).
    ``pipeline``: the store's (pipeline_read, pipeline_write)."""
    store, base, pieces = opt.nvme, opt.optimizer, opt.nvme_pieces
    groups = sorted({key[0] if isinstance(key, tuple) else key for key in streamed})
    sliced = {key[0] for key in streamed if isinstance(key, tuple)}
    staged = {k: _staging(opt.flat_groups[k]) for k in groups} if pieces is None else {}
    steps = {k: base.state[opt.flat_groups[k].master].get("step") for k in groups}
    store.begin()
    if pieces is not None:
        pieces.store.begin()
    error: Optional[BaseException] = None
    try:
        with contextlib.closing(store.stream(streamed, *pipeline)) as keys:
            for key in keys:
                if isinstance(key, tuple):
                    step_slice(*key, combined, staged[key[0]])
                else:
                    step_group(key, combined, staged.get(key))
    except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
        error = exc
    except BaseException:  # KeyboardInterrupt, SystemExit: undone here, no agreement (the job is ending)
        _undo(store, pieces, base, opt, steps)
        raise
    try:
        failed = _agree(error, opt)
    except BaseException:  # the agreement itself failed (a rank died): nothing is committed here
        _undo(store, pieces, base, opt, steps)
        raise
    if failed:
        _undo(store, pieces, base, opt, steps)
        if error is not None and not isinstance(error, OSError):
            raise error  # (a bug, not the drive: the other ranks raise NVMeStepError naming this rank)
        raise _named(failed) from error
    store.commit()
    if pieces is not None:
        pieces.store.commit()
    for k in groups:
        g = opt.flat_groups[k]
        if k in sliced:  # every slice stepped: count the step (a whole group's: by the optimizer's step())
            state = base.state[g.master]
            state["step"] = int(state["step"]) + 1
        if k not in staged:
            continue
        g.flat[g.lo:g.hi].copy_(staged[k], non_blocking=True)
        if g.flat.is_cuda and staged[k].is_pinned():  # the next _staging waits for this copy
            g.staging_copied = torch.cuda.Event()
            g.staging_copied.record(torch.cuda.current_stream(g.flat.device))


def _undo(store, pieces, base, opt, steps) -> None:
    store.rollback()
    if pieces is not None:
        pieces.rollback()
    for k, step in steps.items():
        base.state[opt.flat_groups[k].master]["step"] = step


def _staging(g) -> torch.Tensor:
    """The group's host buffer for its new 16-bit (or fp32) values: made once, handed out again only
    after the copy that read it last completed."""
    if getattr(g, "staging", None) is None or g.staging.dtype != g.dtype:
        g.staging = torch.empty(g.hi - g.lo, dtype=g.dtype, pin_memory=bool(getattr(g, "host", None) and g.host.pin))
    copied = getattr(g, "staging_copied", None)
    if copied is not None:
        copied.synchronize()
        g.staging_copied = None
    return g.staging


def _agree(error: Optional[BaseException], opt) -> Dict[int, int]:
    """(global) rank -> code of every rank whose part of the step failed (empty: all succeeded). Over
    the whole world, not the partition group: MiCS replicas and model-parallel peers outside it step
    too, and must not commit a step that another rank undoes."""
    code = 0 if error is None else (error.errno or errno.EIO) if isinstance(error, OSError) else NOT_IO
    rank, world = comm.get_rank(), comm.get_world_size()
    if world == 1:
        return {rank: code} if code else {}
    codes = torch.zeros(world, dtype=torch.int64, device=collectives.check_device(None, opt.flat_groups[0].flat.device))
    codes[rank] = code
    comm.all_reduce(codes)
    return {r: int(c) for r, c in enumerate(codes.tolist()) if c}


def _named(failed: Dict[int, int]) -> NVMeStepError:
    what = ", ".join(f"rank {r}: " + (f"{errno.errorcode.get(c, c)} ({os.strerror(c)})" if c > 0 else
                                      "an error that is not I/O (raised there)") for r, c in sorted(failed.items()))
    err = next((c for c in failed.values() if c > 0), errno.EIO)
    tail = ("Nothing of this step was applied on any rank: the model and the optimizer state (in memory and in "
            "the swap files) are as before step(), and its gradients are kept. Free space under nvme_path (or "
            "fix the drive), then call engine.step() again to take this step, or engine.zero_grad() to drop it")
    return NVMeStepError(err, f"the optimizer step could not write its state to NVMe ({what}). {tail}", failed)


__all__ = ["NVMeStepError", "nvme_step"]
