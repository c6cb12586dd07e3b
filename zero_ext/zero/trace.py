"""The recorded fetch order of one step: FetchEvent and Trace (pure data: no communication).

A step's fetches -- each module call's forward, its backward, an external parameter's first use -- are
recorded in order as FetchEvents while the coordinator (coordinator.py) is in RECORD. The Trace built
from them answers what the coordinator asks while it prefetches: which event comes next, and when a
parameter a module is releasing will be used again (the *reuse distance*: the elements the trace
fetches in between, DeepSpeed's ``max_reuse_distance`` unit). A trace of forward fetches only (a
forward without autograd: evaluation, a decoding step of generation) is repeated by the next step as it
is, so a parameter's last use in it also has a next use across the step boundary (``wrap_use``): its
first use in the next repetition, at the distance of the fetches after the one and before the other.
"""
from typing import Dict, List, NamedTuple, Sequence, Tuple

from .param import ZeroParam
from .status import FetchKind


class FetchEvent(NamedTuple):
    """One fetch of the step: why, for which module (its index in the model), and the partitioned
    (non-persistent) parameters it needs, in the module's order."""

    kind: FetchKind
    module_index: int
    params: Tuple[ZeroParam, ...]
    numel: int

    def matches(self, kind: FetchKind, module_index: int, params: Sequence[ZeroParam]) -> bool:
        return (self.kind is kind and self.module_index == module_index and len(self.params) == len(params)
                and all(a is b for a, b in zip(self.params, params)))

    def describe(self, namer) -> str:
        return f"{self.kind.name.lower()} of module {namer(self.module_index)}"


def make_event(kind: FetchKind, module_index: int, params: Sequence[ZeroParam]) -> FetchEvent:
    return FetchEvent(kind, module_index, tuple(params), sum(zp.numel for zp in params))


class Reuse(NamedTuple):
    """When a parameter is next used after an event: the event's index and the elements fetched by
    the events strictly between the two."""

    index: int
    distance: int


class Trace:
    """A complete step's events, with each parameter's next use after each event."""

    def __init__(self, events: Sequence[FetchEvent]):
        self.events: List[FetchEvent] = list(events)
        self.next_use: List[Dict[int, Reuse]] = self._next_uses()
        self.forward_only = all(ev.kind is not FetchKind.BACKWARD for ev in self.events)
        self.wrap_use: List[Dict[int, Reuse]] = self._wrap_uses()

    def __len__(self) -> int:
        return len(self.events)

    def _next_uses(self) -> List[Dict[int, Reuse]]:
        # before[k]: elements fetched by events[:k]; distance(i -> j) = before[j] - before[i + 1]
        before = [0]
        for ev in self.events:
            before.append(before[-1] + ev.numel)
        seen: Dict[int, int] = {}  # id(ZeroParam) -> index of its nearest use after the scan position
        out: List[Dict[int, Reuse]] = [{} for _ in self.events]
        for i in range(len(self.events) - 1, -1, -1):
            for zp in self.events[i].params:
                j = seen.get(id(zp))
                if j is not None:
                    out[i][id(zp)] = Reuse(j, before[j] - before[i + 1])
            for zp in self.events[i].params:
                seen[id(zp)] = i
        return out

    def _wrap_uses(self) -> List[Dict[int, Reuse]]:
        first: Dict[int, Tuple[int, int]] = {}  # id(ZeroParam) -> (index of its first use, elements before it)
        before = 0
        for j, ev in enumerate(self.events):
            for zp in ev.params:
                first.setdefault(id(zp), (j, before))
            before += ev.numel
        out: List[Dict[int, Reuse]] = [{} for _ in self.events]
        after = 0  # elements fetched by events[i + 1:], walking backwards
        for i in range(len(self.events) - 1, -1, -1):
            for zp in self.events[i].params:
                if id(zp) not in self.next_use[i]:  # its last use in the step
                    j, before_j = first[id(zp)]
                    out[i][id(zp)] = Reuse(j, after + before_j)
            after += self.events[i].numel
        return out

    def fingerprint(self) -> List[int]:
        """Ints that differ between two traces of different events (kinds, modules, shapes), for the
        ranks to compare; ds_ids are left out (see [Note: fetch-order agreement])."""
        flat: List[int] = []
        for ev in self.events:
            flat += [ev.kind.value, ev.module_index, len(ev.params)]
            for zp in ev.params:
                flat.extend(zp.shape)
                flat.append(-1)
        return flat

    @property
    def numel(self) -> int:
        return sum(ev.numel for ev in self.events)
