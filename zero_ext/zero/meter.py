"""GatherMeter: how many elements of one model's parameters are gathered, now and at most (a leaf).

ZeroModel gives one meter to each of its parameters; ``ZeroParam`` reports to it from its own
transitions (``to_inflight`` adds, partitioning subtracts), so the count is the truth about storage
whoever gathered -- module hooks, the prefetch coordinator, GatheredParameters. Persistent parameters
are left out: they are a fixed cost, bounded by ``model_persistence_threshold``, and
``max_live_parameters`` is about the rest. The coordinator reads ``live`` to stay under
``max_live_parameters``; tests read ``peak``.

``pinned`` counts the model's parameters a GatheredParameters block holds (gathered.py); ZeroModel
listens (``listener``) to learn when every one of them is (see [Note: whole-model gathered] in model.py).
"""


class GatherMeter:
    __slots__ = ("live", "peak", "gathers", "gathered", "pinned", "listener")

    def __init__(self):
        self.live = 0  # elements of non-persistent parameters INFLIGHT or AVAILABLE now
        self.peak = 0  # the most ``live`` has been since the last reset_peak()
        self.gathers = 0  # parameters gathered (one per to_inflight)
        self.gathered = 0  # elements gathered, summed over those gathers
        self.pinned = 0  # parameters held by a GatheredParameters block
        self.listener = None  # called after ``pinned`` changed

    def pin(self, count: int) -> None:
        """``count`` more (or, negative, fewer) parameters are held by GatheredParameters blocks."""
        self.pinned += count
        if self.listener is not None:
            self.listener()

    def add(self, numel: int) -> None:
        self.live += numel
        self.gathers += 1
        self.gathered += numel
        if self.live > self.peak:
            self.peak = self.live

    def sub(self, numel: int) -> None:
        self.live -= numel

    def adjust(self, delta: int) -> None:
        """A gathered parameter became persistent (or stopped being): counted out (or in), no gather."""
        self.live += delta
        self.peak = max(self.peak, self.live)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __repr__(self) -> str:
        return (f"GatherMeter(live={self.live}, peak={self.peak}, gathers={self.gathers}, "
                f"gathered={self.gathered})")
