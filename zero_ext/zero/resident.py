"""Residency: decoding forwards with the whole model kept gathered, checked across ranks on a doubling
schedule instead of once per forward (used by coordinator.py).

[Note: resident decoding]
Decoding repeats one forward-only trace (see [Note: ZeRO-3 prefetch trace]). Followed with a check at
the end of every forward, it costs one small all-gather per token, paid because a rank that leaves the
trace may need a gather the others will not issue: were the end-of-forward check skipped, that rank
would wait in our gather while the others wait in a collective of the caller's (``generate``'s own
per-token all-reduce of ``synced_gpus``), on another channel: a hang. So the check is not skipped; the
need for it is removed. When the trace repeats and every parameter the model's module calls can fetch
fits within ``max_live_parameters`` (and the trace's parameters are all kept under
``max_reuse_distance``), the coordinator makes the model *resident*: at the end of a repetition, in the
check that ends it (whose row carries the decision, so the ranks take it together), it gathers what
the trace did not use and holds all of it. From then on no fetch can issue a collective, whatever
branch a rank takes, so nothing a rank does in a forward can leave another waiting:

- each fetch is compared with the trace locally (no communication); the first one that differs, or a
  forward that ends early, is written down (which forward, which fetch, which module), and the fetches
  after it go into a digest; the forward still computes exactly, every parameter being there;
- the ranks compare what they wrote down in one small all-gather at the end of the 1st, 2nd, 4th, ...,
  64th resident forward and of every 64th after that (``check_due``): 7 checks in the first 64
  forwards, one per 64 after -- amortised to none per token -- and a rank-dependent branch in forward
  f raises FetchOrderError on every rank, naming each rank's first differing fetch, at most 63
  forwards later. Every rank runs those checks at the same forwards, since ranks
  decoding partitioned run the same number of forwards (``synced_gpus=True``);
- residency ends at the start of a forward with autograd (training goes on), at the end of a backward
  (of a graph built before the decoding) and in the refresh after an optimizer step or a checkpoint
  load, each time after one last check of what is not checked yet (every rank is about to run
  collectives of ours there anyway); local calls that release gathered parameters
  (``empty_partition_cache``, ``destroy``, an invalidated trace) end it without one: what they drop
  computed exactly, but is not compared.

What stays uncovered, on some ranks only (on every rank each is exact, tests/test_zero_decoding_edges.py):
a call that releases parameters (``empty_partition_cache``) during decoding, or a parameter registered as
external to a module from outside the model, makes those ranks gather at their next forward while the
others gather nothing. The gather's agreement row meets the others' next check (a named error, when it
comes before a collective of the caller's) or waits behind the caller's own collective (a hang, as in
DeepSpeed). Ranks running different numbers of forwards are caught at the next check both reach (the
forward counts differ), or before training goes on (tests/test_zero_streaming.py). A streaming model
(streaming.py) covers all three: every forward ends with a fence every rank waits for.
"""
from typing import List, Optional

from . import collectives
from .fetch import FetchOrderError, FetchSite, agree_rows, fetch, raise_disagreement, release
from .status import FetchKind, ZeroParamStatus

CHECK_EVERY = 64  # after the 64th resident forward, one check per this many
_LEAVING, _SCHEDULED = 1, 0  # the reason column of a check's row
_ENDED_EARLY = 0  # the kind code of "the forward ended before the trace did"


def check_due(n: int) -> bool:
    """Whether the ``n``-th resident forward (from 1) ends with a check: 1, 2, 4, ..., 64, 128, 192, ..."""
    return n % CHECK_EVERY == 0 if n > CHECK_EVERY else (n & (n - 1)) == 0


class _ResidentHold:
    def __repr__(self) -> str:
        return "kept gathered: decoding with the whole model resident (coordinator.py)"


class Residency:
    """The resident state of one model's decoding: the parameters held and what the forwards did.

    ``trace``: the repeated trace; ``namer``: module index -> name; ``group`` / ``device``: where the
    checks run; ``check``: whether they run (``check_fetch_order``)."""

    def __init__(self, trace, namer, group, device, check: bool):
        self.trace, self.namer, self.group, self.device, self.check = trace, namer, group, device, check
        self.hold = _ResidentHold()
        self.params: List = []
        self.forwards = 0  # resident forwards so far
        self.checks = 0  # checks run
        self._first: Optional[tuple] = None  # (forward, position, kind value, module index) since the last check
        self._log: List[int] = []  # the differing fetches since the last check, for the digest

    # -- entering and leaving -----------------------------------------------------------------------------

    def enter(self, params, check: bool) -> None:
        """Hold ``params`` (every non-persistent parameter the model's calls can fetch), gathering those
        that are partitioned. Collective when some are: every rank decided this in the same check."""
        self.params = list(params)
        missing = [zp for zp in self.params if zp.status is ZeroParamStatus.NOT_AVAILABLE]
        for zp in self.params:
            zp.hold(self.hold)
        if missing:
            fetch(missing, self.hold, FetchSite(FetchKind.PREFETCH, -1, "resident", self.namer), check)

    def leave(self) -> None:
        """Release what residency holds (local: whatever no module call holds is partitioned)."""
        params, self.params = self.params, []
        release(params, self.hold)

    # -- the forwards ------------------------------------------------------------------------------------

    def left_trace(self, position: int, kind: FetchKind, module_index: int) -> None:
        """This forward's fetch at ``position`` is not the trace's (``kind`` None: the forward ended there)."""
        code = kind.value if kind is not None else _ENDED_EARLY
        if self._first is None:
            self._first = (self.forwards + 1, position, code, module_index)
        self._log += [self.forwards + 1, position, code, module_index]

    def off_trace(self, kind: FetchKind, module_index: int, count: int) -> None:
        """A fetch after this forward left the trace."""
        self._log += [kind.value, module_index, count]

    def end_forward(self) -> None:
        """A resident forward ended: check when the schedule says so."""
        self.forwards += 1
        if check_due(self.forwards):
            self.verify(_SCHEDULED)

    def verify(self, reason: int = _LEAVING) -> None:
        """Compare what the ranks' forwards did since the last check (one small all-gather); raise
        FetchOrderError on every rank when they differ. Collective."""
        if not self.check:
            return
        first = self._first
        where = -1 if first is None else (first[0] << 32) | (first[1] << 4) | first[2]
        row = [FetchKind.RESIDENT.value, -1 if first is None else first[3], self.forwards, reason,
               collectives.digest(self._log), where]
        self._first, self._log = None, []
        self.checks += 1
        rows = agree_rows(row, self.group, self.device)
        if all(r == rows[0] for r in rows):
            return
        site = FetchSite(FetchKind.RESIDENT, -1, "", self.namer)
        if any(r[0] != FetchKind.RESIDENT.value for r in rows):  # a rank is at another collective of ours
            raise_disagreement(rows, site)
        lines = "\n".join(f"  rank {r}: {self.describe(other)}" for r, other in enumerate(rows))
        raise FetchOrderError(
            "zero_ext ZeRO-3: the ranks ran different modules while decoding with the model resident (a "
            "rank-dependent branch, or ranks running different numbers of forwards?):\n" + lines + "\n"
            "Every parameter was gathered, so those forwards computed exactly; but the ranks of a partitioned "
            "model must run the same modules in the same order (the gathers of the next training step, or of "
            "decoding that does not fit gathered, depend on it), and the same number of forwards "
            "(generate(..., synced_gpus=True)). Run every branch on every rank and select the result, or "
            "generate inside zero_ext.zero.generation(engine), where ranks may differ. (The check runs after "
            "the 1st, 2nd, 4th, ... resident forward; check_fetch_order=False turns it off.)")

    def describe(self, row) -> str:
        """What a rank's check row says its forwards did."""
        _, module, forwards, reason, _, where = row
        what = ("leaving decoding (a forward with autograd, or the optimizer step) after" if reason == _LEAVING
                else "checking after")
        text = f"{what} {forwards} resident forward(s)"
        if where < 0:
            return text + ", all along the recorded trace since the last check"
        forward, position, code = where >> 32, (where >> 4) & 0xFFFFFFF, where & 0xF
        expected = (self.trace.events[position].describe(self.namer) if position < len(self.trace)
                    else "end of the trace")
        if code == _ENDED_EARLY:
            return (f"{text}; forward {forward} ended after {position} of the trace's {len(self.trace)} fetches "
                    f"(the next is the {expected})")
        return (f"{text}; forward {forward} left the trace at fetch {position}: the "
                f"{FetchKind(code).name.lower()} of module {self.namer(module)}, where the trace has the {expected}")

