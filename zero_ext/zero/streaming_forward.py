"""The coordinator's side of streaming decoding, mixed into PrefetchCoordinator: each forward along a
decoding trace starts from the last one's fence and ends with the next one's (see [Note: streaming
decoding] in streaming.py; the per-gather stamps are there too)."""
from typing import Tuple

from .fetch import FetchOrderError, FetchSite, wait_gathered
from .status import FetchKind, TraceState
from .streaming import Streaming, eligible as streaming_eligible


class StreamedForwards:
    """PrefetchCoordinator's streaming-forward methods (they use its trace, prefetch and agreement state)."""

    def _may_stream(self) -> bool:
        """Whether decoding along this trace can be checked by stamps in its gathers instead of rows."""
        return self.stream_stamps and self.trace.forward_only and streaming_eligible(
            [zp for ev in self.trace.events for zp in ev.params], self._group)

    def _begin_streamed_forward(self) -> None:
        """A decoding forward repeats the trace: go on from what the last one's fence gathered."""
        stream = self._fence = self.streaming
        stream.forwards += 1
        self.stats.streamed_forwards += 1
        self.stats.traced_steps += 1
        self._pos, self._diverged, self._unverified = 0, False, 0
        self._prefetch_ahead()

    def _end_streamed_forward(self, repeat: bool) -> None:
        """The fence that ends every streaming forward (see [Note: streaming decoding])."""
        stream, self._fence = self._fence, None
        if stream.failed:  # raised already, on every rank
            self.drain()
            return
        if not (repeat and self.state is TraceState.COMPLETE and not self._diverged and self._pos == len(self.trace)):
            self.streaming = None  # left the trace, or ended early: a row says where, the others' fences differ
            self._fence_row(stream, (self._pos, int(self._diverged), stream.forwards, 0))
            if self.state is TraceState.COMPLETE:  # (every rank ended the same way: record again)
                self._invalidate(f"the last step ended after {self._pos} of the trace's {len(self.trace)} fetches")
            self.drain()
            return
        self.drain(keep_retained=True)
        self._fence_gathers(stream)

    def _fence_gathers(self, stream: Streaming) -> None:
        """The fence of a forward that followed the trace: the next repetition's first gathers, waited for
        here; a row when none is issued."""
        self._pos = self._ahead = 0
        self._prefetch_ahead()
        try:
            for entry in list(self._prefetched.values()):
                wait_gathered(entry.params)
        except FetchOrderError:
            self.drain()
            raise
        if not self._prefetched:
            self._fence_row(stream, (len(self.trace), 0, stream.forwards, 1))

    def _fence_row(self, stream: Streaming, stamp: Tuple[int, ...]) -> None:
        self.stats.fence_rows += 1
        self._agree(FetchSite(FetchKind.CHECKPOINT, self._last_module, "", self.namer), [], -1, stamp)

    def _fence_lost(self) -> None:
        """A FetchOrderError was raised on every rank in this streaming forward: its end runs no fence."""
        if self._fence is not None:
            self._fence.failed = True
        self.streaming = None

    def _streaming_failed(self) -> None:
        """A streamed gather's stamps differed (raised on every rank): nothing more follows this trace."""
        self.streaming, self._stamped, self.state = None, False, TraceState.INVALID
