"""Streaming decoding: forwards along a repeated trace of a model larger than ``max_live_parameters``,
with the fetch-order check carried inside the gathers themselves (used by coordinator.py).

[Note: streaming decoding]
A model that does not fit ``max_live_parameters`` cannot be resident ([Note: resident decoding]): each
decoding forward gathers again what it cannot keep, prefetched along the trace. Checked as a training
step is ([Note: checking the order along the trace]) that is one agreement row per prefetch batch, per
on-demand gather and at the end of the forward: 16-33 small all-gathers per token. Those rows exist so
that no rank issues a gather the others do not; but a streaming forward's gathers are themselves
collectives every rank joins. So the row rides along: each gather of a streaming forward is one native
op of several tensors -- a *stamp* of six int64 in the columns of an agreement row (kind STREAM, the
batch's first module, the streaming forward's number, its first trace fetch, a digest of its shapes,
the fetch after its last), then the pieces, each landing rank-major in its parameter's own storage (no
copy) -- and its wait compares the ranks' stamps before the values are used. No agreement runs; a stamp
costs 48 bytes per rank per gather.

Why a rank that leaves the trace is still caught on every rank, and none is left waiting:

- the ranks that follow the trace issue the same gathers with the same stamps (every decision depends
  on the trace, the limits and the gathered total only);
- a rank R that leaves it (a branch, a module skipped, a forward ended early) issues from then on only
  agreement rows, each waited for at once: before each on-demand gather ([Note: fetch-order
  agreement]) and, at the end of its forward, a *fence* row;
- every rank's forward ends with a fence that it waits for before returning to the caller (whose own
  collectives, such as ``generate``'s per-token all-reduce, run on another channel): a follower's fence
  is the gather of the next repetition's first fetches (needed anyway: the model does not fit), or,
  when nothing of it fits beside what is kept for reuse, a fence row. So between a divergence and the
  end of that forward every rank issues at least one collective of ours, and none is in flight across
  the caller's code;
- the native transport numbers the ops of a communicator and compares, after the first barrier of
  each, the number, the bytes and the verb (csrc/comm_shm_rounds.c, ``check_stamps``). R's first row
  after the divergence (48 bytes) meets whatever the others issue under the same number: a stamped
  gather (more bytes) fails at once on both sides with "ranks in different collectives", which becomes
  FetchOrderError here (at the follower's wait of that op: its fence at the latest) and in
  fetch.check_agreement; a row meets a row and the rows differ, as ever. Two stamped gathers of the
  same size (ranks at different forwards, or different batches) complete and their stamps differ;
- after such an error a follower may have issued gathers (prefetches) that R will never match. Each
  rank that raised therefore *settles* (``settle``): one labelled native barrier (``Native.agree``).
  Ranks with nothing left in flight meet there and the communicator stays usable; otherwise the barrier
  meets a gather and fails at once on every rank, and the failed communicator is dropped (the group's
  next collective makes a new one, on every rank: all of them raised). The next forward records again.

Ranks that leave the trace at the same fetch agree on it and fetch on demand. Only the native transport
compares ops before moving bytes, so streaming forwards are checked this way where the group's
communicator is native (CPU ranks of one host); elsewhere (NCCL, torch.distributed), for ZeRO++ gathers
(quantized, node-local) and MiCS's two-level gathers, each batch keeps its agreement row. What stays
uncovered is what is uncovered everywhere: a rank that stops calling the model (one more forward on
one rank, then nothing of ours on the others) waits until the others' next collective of ours, or the
transport's timeout.
"""
from typing import Callable, List, Sequence

import torch

from .. import comm
from ..comm import native
from . import collectives
from .fetch import FetchOrderError, describe_rows
from .status import FetchKind

MISMATCH = "ranks in different collectives"  # the native transport's words for mismatched ops
STAMP_WORDS = 6  # int64 per stamp: the columns of an agreement row
_SETTLE = "zero_ext: fetch order error"


def eligible(params: Sequence, group) -> bool:
    """Whether gathers of ``params`` on ``group`` can carry stamps: more than one rank, a native
    communicator, CPU tensors, plain flat gathers."""
    from . import mics

    if collectives.rank_and_world(group)[1] < 2 or native.existing(group) is None:
        return False
    layout = mics.of(group)
    if layout is not None and layout.hierarchy is not None:
        return False
    return all(zp.compute_device.type == "cpu" and not zp.quantized_gathers and not zp.gather_by_all_reduce
               and zp.secondary is None
               for zp in params)


def settle(group) -> None:
    """After a fetch-order error found by comparing rows or stamps: one labelled native barrier, so
    that no rank keeps a gather in flight that the others will never match; if it fails (the ranks'
    ops were out of step), drop the failed communicator. Every rank that raises calls it."""
    nat = native.existing(group)
    if nat is None:
        return
    try:
        nat.agree(_SETTLE)
    except native.CommError:
        native.destroy_group(group if group is not None else torch.distributed.distributed_c10d._get_default_group())


def transport_mismatch(exc: BaseException, group, what: str) -> FetchOrderError:
    """The FetchOrderError for a native "ranks in different collectives" failure (after settling)."""
    settle(group)
    return FetchOrderError(
        f"zero_ext ZeRO-3: the ranks issued different collectives while {what} (a rank-dependent branch, "
        f"or ranks running different numbers of forwards?); the native transport reports: {exc}\n"
        "Every rank must run the same modules in the same order under ZeRO-3 (generate(..., "
        "synced_gpus=True) keeps the number of forwards equal). See [Note: streaming decoding].")


class Streaming:
    """The streaming state of one model's decoding: the forward count the stamps carry, and whether a
    mismatch was raised (the gathers still in flight then finish without raising again)."""

    def __init__(self, group, namer, on_failure: Callable[[], None]):
        self.group, self.namer, self.on_failure = group, namer, on_failure
        self.forwards = 0  # streaming forwards begun
        self.failed = False

    def stamp(self, module_index: int, start: int, end: int, shapes) -> List[int]:
        flat: List[int] = [start, end]
        for shape in shapes:
            flat.extend(shape)
            flat.append(-1)
        return [FetchKind.STREAM.value, module_index, self.forwards, start, collectives.digest(flat), end]

    def carrier(self, row: List[int]) -> "Carrier":
        return Carrier(self, row)

    def fail(self, exc: FetchOrderError) -> None:
        """Raise ``exc`` unless this stream raised already (then the caller finishes quietly)."""
        if self.failed:
            return
        self.failed = True
        self.on_failure()
        raise exc


class Carrier:
    """What ``fetch.issue`` gathers with, for one batch of a streaming forward: the stamp to carry."""

    __slots__ = ("stream", "row")

    def __init__(self, stream: Streaming, row: List[int]):
        self.stream, self.row = stream, row

    def gather_async(self, bucket, outputs) -> "StampedGather":
        return StampedGather(self, [zp.read_piece() for zp in bucket], outputs)


class StampedGather:
    """The gather of one bucket with the carrier's stamp: one native op of several tensors (the stamp,
    then each parameter's piece, each landing rank-major in its output: the parameters' own storage,
    so no copy); ``wait`` compares the stamps before anyone reads the values."""

    __slots__ = ("carrier", "work", "stamps", "done")

    def __init__(self, carrier: Carrier, pieces, outputs):
        group = carrier.stream.group
        world = collectives.rank_and_world(group)[1]
        stamp = torch.tensor(carrier.row, dtype=torch.int64)
        self.stamps = torch.empty(world * STAMP_WORDS, dtype=torch.int64)
        self.carrier, self.done = carrier, False
        # (the facade routes it to the native communicator, which eligible() required, and counts traffic)
        self.work = comm.all_gather_coalesced([self.stamps, *outputs], [stamp, *pieces], group, async_op=True)

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        stream = self.carrier.stream
        try:
            self.work.wait()
        except native.CommError as exc:
            if MISMATCH not in str(exc):
                raise
            error = transport_mismatch(exc, stream.group, "decoding along the trace")
            error.args = (f"{error}\nThis rank was following the recorded trace:\n"
                          f"{describe_rows([self.carrier.row], stream.namer).replace('rank 0', 'this rank')}",)
            stream.fail(error)
            return
        rows = self.stamps.view(-1, STAMP_WORDS).tolist()
        if any(r != rows[0] for r in rows) or rows[0] != self.carrier.row:
            settle(stream.group)
            stream.fail(FetchOrderError(
                "zero_ext ZeRO-3: the ranks gathered different parameters while decoding along the recorded "
                "trace (a rank-dependent branch, or ranks running different numbers of forwards?):\n"
                + describe_rows(rows, stream.namer) + "\nEvery rank must run the same modules in the same "
                "order under ZeRO-3: run every branch on every rank and select the result, or generate inside "
                "zero_ext.zero.generation(engine) when the model fits gathered. (Streaming decoding checks the "
                "order with a stamp in each gather; check_fetch_order=False turns it off.)"))
            return
