"""The end of a save: making its files durable and publishing the tag, before save_checkpoint returns
(the default: the tag is there when the call returns, as with DeepSpeed) or in the background
(``ZERO_EXT_CHECKPOINT_PUBLISH=background``).

[Note: background publish]
In the background mode save_checkpoint returns once every rank's files are written (to the page cache)
and checksummed and rank 0 has written the manifest into the hidden staging folder. What makes the
checkpoint durable and visible runs here, on one thread of rank 0, after the call returned (as torch's
async checkpointing and write-ahead logs do it): fsync every file of the staging folder and the folder itself, put the folder in
place under its tag (files.publish_dir: one atomic step), refresh ``zero_to_fp32.py``, write ``latest``.
Until the last step the tag and ``latest`` still name the previous checkpoint, whole: a process killed
(or a machine losing power) at any moment leaves either that one or the new one, never a half.

Every later checkpoint call waits for it first: the next save_checkpoint, load_checkpoint,
engine.destroy(), engine.wait_for_checkpoint(), this process's zero_to_fp32 functions, and the
interpreter's exit (the thread is not a daemon: Python joins it before exiting). A failure (an fsync's
EIO, a full disk, the folder removed meanwhile) is kept and raised as a ``CheckpointPublishError`` by
the next of those calls, on every rank for the collective ones; at exit it is logged.

Only rank 0 publishes. The other ranks' files are fsynced by rank 0 too when they share its host (the
page cache is the file's, whichever process wrote it); a rank on another host fsyncs its own file before
save_checkpoint returns, so that rank 0's publish never precedes another machine's data.
"""
import atexit
import logging
import os
import threading
from typing import Callable, Optional

from .files import CheckpointError

logger = logging.getLogger("zero_ext.checkpoint")


class CheckpointPublishError(CheckpointError):
    """A save's background part (fsync, putting the folder in place, ``latest``) failed after
    save_checkpoint had returned: that checkpoint was not published; the previous ones are intact."""


def in_background() -> bool:
    """Whether saves publish after save_checkpoint returned (``ZERO_EXT_CHECKPOINT_PUBLISH=background``);
    by default (``sync``) rank 0 waits for the publish inside save_checkpoint, so that the tag and
    ``latest`` are in place when it returns on every rank, as scripts and libraries written for
    DeepSpeed expect."""
    mode = os.environ.get("ZERO_EXT_CHECKPOINT_PUBLISH", "sync")
    if mode not in ("sync", "background"):
        raise ValueError(f"ZERO_EXT_CHECKPOINT_PUBLISH={mode!r}: use 'sync' (the default) or 'background'")
    return mode == "background"


class _Job:
    def __init__(self, what: str, work: Callable[[], None]):
        self.what, self.work, self.error = what, work, None
        self.background = in_background()
        self.thread = threading.Thread(target=self._run, name="zero_ext-checkpoint-publish")

    def _run(self):
        try:
            self.work()
        except BaseException as exc:  # noqa: BLE001 - kept for the next checkpoint call to raise
            self.error = exc


_lock = threading.Lock()
_job: Optional[_Job] = None  # in flight, or finished with an outcome nobody has taken yet


def start(what: str, work: Callable[[], None]) -> None:
    """Runs ``work`` (the publish of ``what``, e.g. "save_checkpoint('/ckpt', tag='step10')") in the
    background. The previous job must have been settled (``settle``)."""
    global _job
    with _lock:
        if _job is not None:
            raise RuntimeError(f"zero_ext: {_job.what} is still being published")  # (a zero_ext bug)
        _job = _Job(what, work)
        _job.thread.start()


def settle() -> Optional[str]:
    """Waits for this process's publish in flight, if any. Returns None, or (once) the message of the
    CheckpointPublishError its failure makes."""
    global _job
    with _lock:
        job, _job = _job, None
    if job is None:
        return None
    job.thread.join()
    if job.error is None:
        return None
    said = "returned, but its" if job.background else "failed: its"
    return (f"{job.what} {said} checkpoint was not published: {type(job.error).__name__}: "
            f"{job.error}. The tag and `latest` still name the previous checkpoint, whole; its files stay "
            "in the hidden staging folder until the next save there. Free the disk or fix the folder, then "
            "save again")


def wait() -> None:
    """settle(), raising the failure here (the non-collective callers: destroy, zero_to_fp32)."""
    message = settle()
    if message is not None:
        raise CheckpointPublishError(message)


def pending() -> bool:
    with _lock:
        return _job is not None and _job.thread.is_alive()


@atexit.register
def _at_exit():
    # the interpreter has joined the thread already (not a daemon); a failure nobody took is logged
    message = settle()
    if message is not None:
        logger.error("zero_ext: %s", message)
