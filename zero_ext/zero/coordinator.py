"""PrefetchCoordinator: a model's fetches along the recorded fetch order -- ahead of the compute, within
the memory limits, and checked across ranks once per batch rather than once per fetch.

    coordinator.begin_step()              # the root's forward begins (ZeroModel.enter_forward)
    coordinator.fetch(call, kind)         # a module call needs its parameters (hooks.py)
    coordinator.release(call)             # ... and is done with them
    coordinator.checkpoint()              # end of forward / backward, before a gradient reduction
    coordinator.end_step()                # end of backward (or of a forward without autograd)

[Note: ZeRO-3 prefetch trace]
The first step is recorded: every fetch a module call makes (forward, backward, an external
parameter's first use) becomes a FetchEvent (trace.py) with the call's partitioned parameters. At the
start of the next step the ranks compare their traces in one small all-gather; if they agree the
trace is COMPLETE (status.TraceState), else it is recorded again. Along a complete trace:

- each fetch must be the trace's next event; then the gathers for the events after it are issued
  ahead (asynchronous all-gathers: on gloo they run in its threads, with NCCL on its stream), up to
  ``prefetch_bucket_size`` elements not yet used, refilled once less than half of that is left, and
  never past ``max_live_parameters`` gathered elements (GatherMeter.live). The walk stops at the first
  event that does not fit, so what is in flight is always for the events just ahead;
- a module's release keeps a parameter gathered when the trace uses it again after fewer than
  ``max_reuse_distance`` elements of fetches (0 keeps nothing), if the gathered total stays within
  ``max_live_parameters``; such kept parameters are the first given up when an on-demand gather
  would pass the limit. A module whose own parameters exceed the limit is still gathered: the live
  set is at most max(max_live_parameters, what the running module calls hold);
- nothing stays gathered from a backward into the next step: the end of backward releases what the
  coordinator holds (the optimizer step changes the pieces next). A step that is a forward without
  autograd (evaluation, a decoding step of generation) over a trace of forward fetches only is repeated
  as it is by the next step, so there a parameter's last use reaches into the next repetition
  (Trace.wrap_use) and is kept under the same two limits: decoding with a model within
  ``max_live_parameters`` gathers it once; once such a repetition ends, the whole model is held and the
  per-forward checkpoint gives way to checks on a doubling schedule (see [Note: resident decoding] in
  resident.py). Whatever changes the pieces (the optimizer step, a checkpoint load) goes through
  ``refresh_persistent``, which drains the kept parameters with the persistent ones.
A fetch that is not the next event (dynamic control flow: a branch taken, a module skipped, a forward
without backward) invalidates the trace: what was prefetched is waited for and released, and the rest
of the step fetches on demand (a debug log says where; ``log_trace_cache_warnings`` makes it a
warning). The next step records again. Every decision depends on the trace, the limits and the
gathered total only, so ranks that follow the same trace issue the same collectives in the same order.

[Note: checking the order along the trace]
Without a trace every gather is preceded by its agreement row (fetch.py). Along a trace the events
are checked locally against the trace, and the agreement runs once per *batch*: one row before each
prefetch batch describing all of its gathers, and one *checkpoint* row at the end of each forward and
backward and before each gradient reduction (``verify``) when events were consumed since the last row.
Every row of a step that follows a trace carries the position reached in it, and whether this rank
left it. So a rank that leaves the trace, say at event q while the others go on, runs an agreement at
once (its row: the module it runs, position q, "left"); the others run theirs no later than their
next gather, reduction or end of pass, with a different position or kind; the rows differ and every
rank raises FetchOrderError naming each rank's module and parameter. No rank issues a gather or a
reduction between the divergence and that agreement, so there is no mismatched collective to hang in;
the gathers prefetched before it were issued by every rank and complete. Ranks that all change
branch at the same event agree on (q, "left") and simply fetch on demand. What is not covered is what
was not before: a collective of the user's own between two of ours.
"""
import logging
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import collectives, internal
from .fetch import FetchOrderError, FetchSite, agree_rows, check_agreement, issue, raise_disagreement, release
from .fetch import wait_gathered
from .meter import GatherMeter
from .param import ZeroParam
from .resident import Residency
from .status import FetchKind, TraceState, ZeroParamStatus
from .streaming import Streaming
from .streaming_forward import StreamedForwards
from .trace import Trace, make_event

logger = logging.getLogger("zero_ext.zero.coordinator")


class _Hold:
    """A hold the coordinator puts on parameters it keeps gathered for no module call in particular."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why

    def __repr__(self) -> str:
        return self.why


class _PrefetchHold:
    """The hold of a prefetch for one trace event (described only when someone asks: it is made per
    event per step)."""

    __slots__ = ("index", "event", "namer")

    def __init__(self, index: int, event, namer):
        self.index, self.event, self.namer = index, event, namer

    def __repr__(self) -> str:
        return f"prefetch for fetch {self.index} of the trace ({self.event.describe(self.namer)})"


class _Prefetched(NamedTuple):
    hold: "_PrefetchHold"
    params: Tuple[ZeroParam, ...]  # all of the event's parameters: gathered for it or found gathered
    issued: int  # elements this prefetch gathered


class PrefetchStats:
    """Counters of what the coordinator did (diagnostics, benchmarks and tests)."""

    __slots__ = ("recorded", "traced_steps", "batches", "prefetched", "served_ahead", "on_demand", "retained",
                 "invalidations", "checkpoints", "resident_forwards", "resident_checks", "streamed_forwards",
                 "fence_rows")

    def __init__(self):
        for name in self.__slots__:
            setattr(self, name, 0)

    def as_dict(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self) -> str:
        return "PrefetchStats(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"


class PrefetchCoordinator(StreamedForwards):
    """Fetch and release for one ZeroModel's module calls; see [Note: ZeRO-3 prefetch trace].

    ``namer``: module index -> "name (Type)"; ``meter``: the model's GatherMeter; ``check``: run the
    fetch-order agreements; the three limits are DeepSpeed's stage3_* keys, in elements.
    """

    def __init__(self, namer, meter: GatherMeter, check: bool = True, prefetch_bucket_size: int = 50_000_000,
                 max_live_parameters: int = 1_000_000_000, max_reuse_distance: int = 1_000_000_000,
                 warn_on_invalidation: bool = False):
        self.namer, self.meter, self.check = namer, meter, check
        self.bucket = max(0, int(prefetch_bucket_size))
        self.max_live = max(0, int(max_live_parameters))
        self.max_reuse = max(0, int(max_reuse_distance))
        self._log_level = logging.WARNING if warn_on_invalidation else logging.DEBUG
        self.state = TraceState.RECORD
        self.trace: Optional[Trace] = None
        self.stats = PrefetchStats()
        self._recording = []
        self._group, self._device = None, None  # where the trace's agreements run
        self._pos = 0  # the next trace event expected
        self._stamped = False  # this step follows a trace and checks: agreement rows carry the position
        self._diverged = False  # this step left the trace
        self._left = ""  # where and how (for error messages)
        self._unverified = 0  # events consumed since this rank's last agreement
        self._last_module = -1  # the module of the last event consumed (for checkpoint rows)
        self._ahead = 0  # events before this index are consumed or prefetched
        self._prefetched: Dict[int, _Prefetched] = {}  # event index -> what was prefetched for it
        self._pending = 0  # elements prefetched for events not consumed yet
        self._retained: Dict[ZeroParam, int] = {}  # kept for reuse -> the event that uses it next
        self._retain_hold = _Hold("kept gathered for reuse (stage3_max_reuse_distance)")
        self._carry = False  # the step that ended repeats its trace next: what is kept for it stays
        self.residency: Optional[Residency] = None  # decoding with the whole model gathered (resident.py)
        self.resident_candidates = lambda: []  # every parameter the model's calls can fetch (set by ZeroModel)
        self.streaming: Optional[Streaming] = None  # decoding checked by stamps in the gathers (streaming.py)
        self._fence: Optional[Streaming] = None  # set during a streaming forward: it ends with a fence
        self.stream_stamps = True  # False: streaming forwards keep a row per batch (what benchmarks compare)

    # -- step boundaries ---------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """The root's forward begins: settle the last step's trace and start following (or recording)."""
        if self.residency is not None:
            if not torch.is_grad_enabled():  # decoding goes on: nothing to settle, nothing to fetch
                self._pos, self._diverged = 0, False
                return
            self.end_residency(check=True)  # training goes on: last check, then gathered as it needs
        if self.streaming is not None:
            if not torch.is_grad_enabled() and self.state is TraceState.COMPLETE:
                self._begin_streamed_forward()
                return
            # training goes on (every streamed gather was checked by its stamps and each forward's fence);
            # the last forward followed the trace to its end, its fence prefetched for a repetition that
            # did not come (released by the drain)
            self.streaming, self._pos = None, len(self.trace) if self.trace is not None else 0
        self.drain(keep_retained=self._carry)
        self._carry = False
        if self.state is TraceState.RECORD and self._recording:
            self._finish_recording()
        elif self.state is TraceState.COMPLETE and self._pos != len(self.trace):
            self._invalidate(f"the last step ended after {self._pos} of the trace's {len(self.trace)} fetches")
        if self.state is TraceState.INVALID:
            self.state, self.trace = TraceState.RECORD, None
        self._recording = []
        self._pos = self._ahead = self._unverified = 0
        self._diverged = False
        self._stamped = self.state is TraceState.COMPLETE and self.check
        if self.state is TraceState.COMPLETE:
            self.stats.traced_steps += 1
            self._prefetch_ahead()  # the first modules' gathers too: their agreement is the batch's

    def end_step(self, repeat: bool = False) -> None:
        """End of backward (or, ``repeat``, of a forward without autograd): check, then release what is
        held ahead -- except, after a forward-only step that followed its trace to the end, what is kept for
        the trace's next repetition (see [Note: ZeRO-3 prefetch trace]), or the whole model when it fits
        (see [Note: resident decoding] in resident.py)."""
        if self.residency is not None and not repeat:  # a backward (of a graph from before decoding) ended
            self.end_residency(check=True)
        if self._fence is not None:
            self._end_streamed_forward(repeat)
            return
        if not repeat:
            self.streaming = None
        if self.residency is not None:
            if not self._diverged and self._pos != len(self.trace):
                self.residency.left_trace(self._pos, None, -1)
            residency, before = self.residency, self.residency.checks
            self.stats.resident_forwards += 1
            try:
                residency.end_forward()
            except FetchOrderError:
                self.state = TraceState.INVALID  # the next step records again, nothing held
                self.end_residency()
                raise
            finally:
                self.stats.resident_checks += residency.checks - before
            return
        self._carry = (repeat and self.state is TraceState.COMPLETE and not self._diverged
                       and self.trace.forward_only and self._pos == len(self.trace))
        resident = self._carry and self._fits_resident()
        stream = self._carry and not resident and self._stamped and self._may_stream()
        if (resident or stream) and self._stamped:  # the check that ends this step carries the decision
            self._unverified = 0
            self.stats.checkpoints += 1
            self._agree(FetchSite(FetchKind.CHECKPOINT, self._last_module, "", self.namer), [], -1,
                        self._stamp() + (1 if resident else 2,))
        else:
            self.checkpoint()
        self.drain(keep_retained=self._carry)
        if resident:
            self._become_resident()
        elif stream:
            self.streaming, self._stamped = Streaming(self._group, self.namer, self._streaming_failed), False
            self._fence_gathers(self.streaming)

    # -- resident decoding (resident.py) -----------------------------------------------------------------

    def _fits_resident(self) -> bool:
        """Whether the whole model may stay gathered: the trace's parameters are all kept for its next
        repetition, and everything the model's calls can fetch fits within max_live_parameters."""
        kept = {id(zp) for zp in self._retained}
        if any(id(zp) not in kept for ev in self.trace.events for zp in ev.params):
            return False
        candidates = self.resident_candidates()
        return (bool(candidates) and all(zp.group is self._group for zp in candidates)
                and sum(zp.numel for zp in candidates) <= self.max_live)

    def _become_resident(self) -> None:
        residency = Residency(self.trace, self.namer, self._group, self._device, self.check)
        try:
            residency.enter(self.resident_candidates(), self.check)
        except BaseException:
            residency.leave()
            raise
        self.residency = residency
        self._stamped = False  # resident forwards run no agreement rows (only the residency's checks)
        retained, self._retained = list(self._retained), {}  # the resident hold covers them
        release(retained, self._retain_hold)

    def end_residency(self, check: bool = False) -> None:
        """Stop holding the whole model gathered; ``check`` first compares what the forwards since the
        last check did (collective: call it where every rank does)."""
        residency, self.residency = self.residency, None
        if residency is None:
            return
        try:
            if check:
                self.stats.resident_checks += 1 if residency.check else 0
                residency.verify()
        except FetchOrderError:
            self.state = TraceState.INVALID
            raise
        finally:
            residency.leave()

    def _finish_recording(self) -> None:
        trace = Trace(self._recording)
        first = trace.events[0].params[0]
        if any(zp.group is not first.group for ev in trace.events for zp in ev.params):
            self._invalidate("the model's parameters are in more than one process group; prefetching "
                             "is implemented for one")
            return
        self._group = first.group
        self._device = collectives.check_device(first.group, first.compute_device)
        # the traces of all ranks must be the same for their prefetches to match: compare them (one
        # small all-gather per recording); if they differ, keep fetching on demand (each fetch checked)
        row = [FetchKind.TRACE.value, -1, len(trace), trace.numel, collectives.digest(trace.fingerprint()), 0]
        rows = agree_rows(row, self._group, self._device, counted=False)
        if any(r[0] != FetchKind.TRACE.value for r in rows):  # a rank is elsewhere (e.g. GatheredParameters)
            raise_disagreement(rows, FetchSite(FetchKind.TRACE, namer=self.namer))
        if any(r[:5] != rows[0][:5] for r in rows):
            self._invalidate("the ranks recorded different fetch orders")
            return
        self.state, self.trace = TraceState.COMPLETE, trace
        self.stats.recorded += 1
        logger.debug("ZeRO-3 fetch trace recorded: %d fetches, %d elements", len(trace), trace.numel)

    # -- fetch and release -------------------------------------------------------------------------------

    def fetch(self, call, kind: FetchKind, params: Optional[Sequence[ZeroParam]] = None) -> None:
        """``call`` (a hooks.ModuleCall) needs ``params`` (default: all of its parameters) gathered."""
        params = call.params if params is None else params
        for zp in params:
            zp.hold(call)
        traced = [zp for zp in params if not zp.persist]
        if self.residency is not None:
            self._resident_fetch(call, kind, params, traced)
            return
        if traced:
            if self.state is TraceState.COMPLETE and self._follow(call, kind, traced, params):
                return
            if self.state is TraceState.RECORD:
                self._recording.append(make_event(kind, call.state.index, traced))
        try:
            issue(params, call.state.site(kind), self.check, self._stamp())
        except FetchOrderError as exc:
            self._fence_lost()
            if self._diverged:  # this rank's own view of where it left the trace
                exc.args = (f"{exc}\nThis rank left the recorded fetch order: {self._left}",)
            raise
        wait_gathered(params)

    def _resident_fetch(self, call, kind: FetchKind, params, traced) -> None:
        """A fetch while the model is resident: compared with the trace, nothing gathered."""
        if traced:
            i, index = self._pos, call.state.index
            if self._diverged:
                self.residency.off_trace(kind, index, len(traced))
            elif i < len(self.trace) and self.trace.events[i].matches(kind, index, traced):
                self._pos = i + 1
            else:
                self._diverged = True
                self.residency.left_trace(i, kind, index)
        if any(zp.status is not ZeroParamStatus.AVAILABLE for zp in params):
            # not held resident (registered as external during decoding): on demand, agreed as before
            issue(params, call.state.site(kind), self.check)
            wait_gathered(params)

    def _follow(self, call, kind: FetchKind, traced, params) -> bool:
        """The fetch along a complete trace; False when it leaves the trace (then fetched on demand)."""
        i, index = self._pos, call.state.index
        ev = self.trace.events[i] if i < len(self.trace) else None
        if ev is None or not ev.matches(kind, index, traced):
            expected = ev.describe(self.namer) if ev is not None else "end of the trace"
            self._leave(f"fetch {i} is the {kind.name.lower()} of module {self.namer(index)}, the trace has "
                        f"the {expected}", call.state.site(kind), traced)
            return False
        self._pos, self._last_module = i + 1, index
        self._unverified += 1
        if kind is not FetchKind.EXTERNAL:
            call.trace_index = i
        self._consume(i)
        missing = [zp for zp in params if zp.status is ZeroParamStatus.NOT_AVAILABLE]
        if missing:
            self._make_room(sum(zp.numel for zp in missing if not zp.persist), traced)
            if self._fence is not None:
                issue(missing, call.state.site(kind), False, carried=self._fence.carrier(
                    self._fence.stamp(index, i, i + 1, [zp.shape for zp in missing])))
            else:
                issue(missing, call.state.site(kind), self.check, self._stamp())
            if self.check:
                self._unverified = 0
            self.stats.on_demand += 1
        else:
            self.stats.served_ahead += 1
        self._prefetch_ahead()  # issued before waiting: the next gathers start while this one finishes
        wait_gathered(params)
        return True

    def release(self, call) -> None:
        """``call`` is done with its parameters: keep those the trace reuses soon, release the rest."""
        i, call.trace_index = call.trace_index, -1
        if i >= 0 and self.state is TraceState.COMPLETE and not self._diverged and self.residency is None:
            # a forward-only trace without autograd repeats as it is: last uses reach into the next step
            wrap = self.trace.forward_only and not torch.is_grad_enabled()
            if self.trace.next_use[i] or (wrap and self.trace.wrap_use[i]):
                self._retain(call, i, wrap)
        release(call.params, call)

    def checkpoint(self) -> None:
        """Agree on the trace events consumed since this rank's last agreement (see [Note: checking the
        order along the trace]); nothing to do when there are none."""
        if not (self._stamped and self._unverified):
            return
        self._unverified = 0
        self.stats.checkpoints += 1
        self._agree(FetchSite(FetchKind.CHECKPOINT, self._last_module, "", self.namer), [], -1, self._stamp())

    def drain(self, keep_retained: bool = False) -> None:
        """Wait for the prefetches in flight and drop every hold of the coordinator (what no module call
        holds is partitioned), or all but those kept for reuse. Local: the gathers waited for were issued
        on every rank. Ends residency, unchecked."""
        if self.residency is not None:
            self.end_residency()
        entries, self._prefetched = list(self._prefetched.values()), {}
        for entry in entries:
            release(entry.params, entry.hold)
        if not keep_retained:
            retained, self._retained = list(self._retained), {}
            release(retained, self._retain_hold)
        self._pending = 0
        self._ahead = self._pos

    # -- along the trace ---------------------------------------------------------------------------------

    def _stamp(self) -> Tuple[int, ...]:
        return (self._pos, int(self._diverged)) if self._stamped else ()

    def _consume(self, i: int) -> None:
        """Event ``i`` runs: its call holds its parameters now, so the coordinator's holds go."""
        entry = self._prefetched.pop(i, None)
        if entry is not None:
            self._pending -= entry.issued
            for zp in entry.params:
                zp.unhold(entry.hold)
        if self._retained:
            for zp in self.trace.events[i].params:
                if self._retained.pop(zp, None) is not None:
                    zp.unhold(self._retain_hold)

    def _prefetch_ahead(self) -> None:
        if self.bucket == 0 or self._pending > self.bucket // 2:
            return  # refill once half of the bucket is used: batches of at least half a bucket
        events = self.trace.events
        room = self.max_live - self.meter.live
        j = max(self._ahead, self._pos)
        batch: List[Tuple[int, List[ZeroParam]]] = []
        planned, total = set(), 0
        while j < len(events):
            need = [zp for zp in events[j].params
                    if zp.status is ZeroParamStatus.NOT_AVAILABLE and id(zp) not in planned]
            n = sum(zp.numel for zp in need)
            if self._pending + total + n > self.bucket or total + n > room:
                break
            batch.append((j, need))
            planned.update(id(zp) for zp in need)
            total += n
            j += 1
        if not batch:
            return
        self._ahead = j
        needed = [zp for _, need in batch for zp in need]
        if not needed:
            return
        stream, carried = self._fence or self.streaming, None
        if stream is not None:  # streaming decoding: the batch's gathers carry its stamp instead of a row
            carried = stream.carrier(stream.stamp(events[batch[0][0]].module_index, batch[0][0], j,
                                                  [zp.shape for zp in needed]))
        elif needed and self.check:  # one agreement for the whole batch, stamped with where it starts and ends
            site = FetchSite(FetchKind.PREFETCH, events[batch[0][0]].module_index, "", self.namer)
            self._agree(site, [zp.shape for zp in needed], needed[0].ds_id, self._stamp() + (batch[0][0], j))
            self._unverified = 0
        with internal.labelled(f"zero_ext::prefetch (fetches {batch[0][0]}-{j - 1})"):
            for k, need in batch:
                ev = events[k]
                if not need and not any(id(zp) in planned for zp in ev.params):
                    continue  # gathered before this batch (kept for reuse): no prefetch to hold it for
                hold = _PrefetchHold(k, ev, self.namer)
                for zp in ev.params:
                    zp.hold(hold)
                issued = issue(need, FetchSite(ev.kind, ev.module_index, "", self.namer), check=False,
                               carried=carried)
                self._prefetched[k] = _Prefetched(hold, ev.params, issued)
                self._pending += issued
        self.stats.batches += 1
        self.stats.prefetched += len(needed)

    def _retain(self, call, i: int, wrap: bool) -> None:
        reuse, wrapped = self.trace.next_use[i], self.trace.wrap_use[i] if wrap else {}
        leaving = [zp for zp in call.params if not zp.persist and zp.held_only_by(call)
                   and zp.status is not ZeroParamStatus.NOT_AVAILABLE]
        after = self.meter.live  # the gathered total once those not kept are released
        for zp in leaving:
            after -= zp.numel
        n, hold, retained = len(self.trace), self._retain_hold, self._retained
        for zp in leaving:
            r, later = reuse.get(id(zp)), 0
            if r is None:
                r, later = wrapped.get(id(zp)), n  # used next in the next repetition
            # strictly fewer elements in between, as DeepSpeed counts: max_reuse_distance 0 keeps nothing
            if r is not None and r.distance < self.max_reuse and after + zp.numel <= self.max_live:
                zp.hold(hold)
                retained[zp] = r.index + later
                after += zp.numel
                self.stats.retained += 1

    def _make_room(self, numel: int, keep: Sequence[ZeroParam]) -> None:
        """Before an on-demand gather of ``numel`` elements: give up kept parameters (furthest next use
        first) until it fits under max_live_parameters, or none is left."""
        if not self._retained or self.meter.live + numel <= self.max_live:
            return
        keep_ids = {id(zp) for zp in keep}
        for zp, _ in sorted(self._retained.items(), key=lambda item: -item[1]):
            if self.meter.live + numel <= self.max_live:
                break
            if id(zp) not in keep_ids:
                del self._retained[zp]
                release([zp], self._retain_hold)

    def _leave(self, reason: str, site: FetchSite, traced: Sequence[ZeroParam]) -> None:
        self._diverged, self._left = True, reason
        self._invalidate(reason)
        if self._stamped:  # tell the other ranks at once (see [Note: checking the order along the trace])
            self._unverified = 0
            self._agree(site, [zp.shape for zp in traced], traced[0].ds_id, self._stamp())

    def _agree(self, site: FetchSite, shapes, first_ds_id: int, stamp: Tuple[int, ...]) -> None:
        """check_agreement on the trace's group; on FetchOrderError nothing stays gathered ahead."""
        try:
            check_agreement(site, shapes, first_ds_id, self._group, self._device, stamp)
        except FetchOrderError as exc:
            self._fence_lost()
            if self._diverged:  # this rank's own view of where it left the trace
                exc.args = (f"{exc}\nThis rank left the recorded fetch order: {self._left}",)
            self._stamped = False  # the step is lost: the raise unwinds it, the next one records again
            self.state = TraceState.INVALID
            self.drain()
            raise

    def is_invalid(self) -> bool:
        return self.state is TraceState.INVALID

    def is_complete(self) -> bool:
        return self.state is TraceState.COMPLETE

    def is_recording(self) -> bool:
        return self.state is TraceState.RECORD

    def invalidate(self, reason: str) -> None:
        """Forget the trace (what it prefetched or kept is released); the next step records again.
        Local: every rank must do it at the same point (between steps)."""
        self._invalidate(reason)

    def _invalidate(self, reason: str) -> None:
        self.stats.invalidations += 1
        logger.log(self._log_level, "zero_ext ZeRO-3: fetch trace invalidated (%s); fetching on demand, "
                   "recording again from the next step", reason)
        self.state = TraceState.INVALID
        self.drain()
