"""``offload_param.device = "nvme"`` (ZeRO-Infinity, stage 3): the 16-bit parameter pieces in swap files.

Each optimizer sub-group keeps its trainable pieces back to back in one buffer (ShardGroup.flat, whose
views are the parameters' ``ds_tensor``); that buffer is one swap group here, and each frozen (or, in
a forward-only engine, every) piece is a group of its own. Outside a use, the buffer and the pieces are
empty tensors (identity kept, as in nvme/store.py). The pieces are brought into host memory only where
they are used, through the store's ``buffer_count`` buffers:
- a gather reads each piece and copies it out at once (``read``): one buffer at a time; up to
  ``offload_param.max_in_cpu`` elements of recently read groups stay cached in host memory (exact
  copies, refreshed by every write-back), so a backward's gather after the forward's reads no file;
- the optimizer step makes one sub-group's buffer resident, writes the new 16-bit values, writes back;
- a modified full value (GatheredParameters with ``modifier_rank``, Module.apply) is written back into
  its piece (``resident``);
- checkpoints and the state routines bring the groups they touch into ordinary memory for the call
  (``materialized``); offload_states leaves the pieces where they are (they are not on the accelerator).
"""
import contextlib
from collections import OrderedDict
from typing import Dict, Hashable, List, Tuple

import torch

from .store import NVMeStateStore


class NVMePieces:
    def __init__(self, store: NVMeStateStore, max_in_cpu: int = 0):
        self.store = store
        # offload_param.max_in_cpu: up to this many elements of groups stay cached in host memory
        # (least recently read dropped first), exact copies kept current by every write-back
        self.max_in_cpu = max_in_cpu
        self._cache: "OrderedDict[Hashable, torch.Tensor]" = OrderedDict()
        self._cached = 0
        self._views: Dict[Hashable, List[Tuple[object, int, int]]] = {}  # key -> (ZeroParam, offset, size)
        self._key_of: Dict[int, Hashable] = {}  # id(ZeroParam) -> key
        self._resident: Dict[Hashable, int] = {}  # key -> nesting depth of resident()/materialized()
        self._owners: List[object] = []  # every ZeroParam whose piece is here
        self._writing: Dict[Hashable, bool] = {}  # key -> whether its outermost use writes it back

    # -- registration --------------------------------------------------------------------------------------

    def add_buffer(self, key: Hashable, flat: torch.Tensor, members, spare_slot: bool = False) -> None:
        """A buffer whose views are the pieces of ``members`` ((ZeroParam, offset, size) each).
        ``spare_slot``: it gets a spare file, so that a step writing it can be undone (rollback)."""
        self.store.register(key, [flat], spare_slot=spare_slot)
        self._views[key] = list(members)
        for zp, _, _ in members:
            self._key_of[id(zp)] = key
            zp.place_piece(self)
            self._owners.append(zp)
        self._point(key, None)

    def holds(self, zp) -> bool:
        """Whether this store keeps zp's piece."""
        return id(zp) in self._key_of

    def add_piece(self, key: Hashable, zp) -> None:
        """A piece that is its own tensor (frozen parameters)."""
        self.store.register(key, [zp.shard])
        self._views[key] = []
        self._key_of[id(zp)] = key
        zp.place_piece(self)
        self._owners.append(zp)

    def forget(self, zp) -> None:
        """A piece that is its own group leaves the store (its value moved elsewhere: the engine's
        sub-group buffer at initialize); its swap file is removed."""
        key = self._key_of.pop(id(zp))
        self.store.unregister(key)
        del self._views[key]
        dropped = self._cache.pop(key, None)
        if dropped is not None:
            self._cached -= dropped.numel()
        self._owners = [o for o in self._owners if o is not zp]
        zp.place_piece(None)

    def _point(self, key, flat) -> None:
        """The pieces of a buffer group follow its storage: views of it while resident, empty otherwise."""
        for zp, off, size in self._views[key]:
            zp.shard.data = flat[off:off + size] if flat is not None else torch.empty(0, dtype=zp.dtype)

    # -- use ---------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def resident_key(self, key: Hashable, modified: bool):
        if self._resident.get(key):
            if modified and not self._writing.get(key):  # the outer use would not write it back: lost
                raise RuntimeError(f"NVMe piece group {key!r}: a write inside a read-only use; bring it in "
                                   "with modified=True in the outer use")
            self._resident[key] += 1
            try:
                yield
            finally:
                self._resident[key] -= 1
            return
        with self.store.resident(key, modified=modified) as tensors:
            self._resident[key] = 1
            self._writing[key] = modified
            if self._views[key]:
                self._point(key, tensors[0])
            try:
                yield
            finally:
                self._resident[key] = 0
                if modified:
                    self._refresh(key, tensors[0])
                if self._views[key]:
                    self._point(key, None)

    def resident(self, zp, modified: bool = True):
        """``zp``'s piece in memory for the block (its whole group), written back after it if modified."""
        return self.resident_key(self._key_of[id(zp)], modified)

    def read(self, zp) -> torch.Tensor:
        """``zp``'s piece, for a gather (which packs its input at once): from the host cache, or read from
        NVMe (and cached when max_in_cpu allows)."""
        key = self._key_of[id(zp)]
        data = self._cache.get(key)
        if data is None:
            with self.resident_key(key, modified=False):
                data = self.store.tensors(key)[0].detach().clone()
            self._remember(key, data)
        else:
            self._cache.move_to_end(key)
        return self._piece_of(key, zp, data)

    def _piece_of(self, key, zp, data: torch.Tensor) -> torch.Tensor:
        for owner, off, size in self._views[key]:
            if owner is zp:
                return data[off:off + size]
        return data  # a piece that is its own group

    def _remember(self, key, data: torch.Tensor) -> None:
        n = data.numel()
        if n > self.max_in_cpu:
            return
        while self._cached + n > self.max_in_cpu and self._cache:
            _, old = self._cache.popitem(last=False)
            self._cached -= old.numel()
        self._cache[key] = data
        self._cached += n

    def _refresh(self, key, data: torch.Tensor) -> None:
        """A group was written: its cached copy follows."""
        cached = self._cache.get(key)
        if cached is not None:
            cached.copy_(data)

    def rollback(self) -> None:
        """The store's open transaction undone (nvme/store.py); cached copies refreshed by its writes
        are dropped (the next read takes the group's good data from NVMe)."""
        for key in self.store.transaction_keys():
            dropped = self._cache.pop(key, None)
            if dropped is not None:
                self._cached -= dropped.numel()
        self.store.rollback()

    def cached_tensors(self):
        return list(self._cache.values())

    @contextlib.contextmanager
    def materialized(self, modified: bool, keys=None):
        """The pieces of groups ``keys`` (default: every piece) in ordinary host memory for the block
        (checkpoints, state routines), written back after it if ``modified``."""
        keys = [k for k in (self._views if keys is None else keys) if not self._resident.get(k)]
        with self.store.in_memory(keys, modified):
            for k in keys:
                self._resident[k], self._writing[k] = 1, modified
                if self._views[k]:
                    self._point(k, self.store.tensors(k)[0])
            try:
                yield
            finally:
                for k in keys:
                    self._resident[k] = 0
                    if modified:
                        self._refresh(k, self.store.tensors(k)[0])
                    if self._views[k]:
                        self._point(k, None)

    def bring_home(self) -> None:
        """Every piece back in ordinary host memory for good, and the swap files removed (engine.destroy():
        the model keeps its weights)."""
        copies = {}
        for k in self._views:
            with self.store.resident(k, modified=False) as tensors:
                copies[k] = (tensors[0], tensors[0].detach().clone())
        self.store.destroy()  # (releases every registered tensor)
        for k, (t, copy) in copies.items():
            t.data = copy
            if self._views[k]:
                self._point(k, copy)
        for zp in self._owners:
            zp.place_piece(None)
        self._views, self._key_of, self._owners = {}, {}, []

    def nvme_bytes(self) -> int:
        return self.store.nvme_bytes()
