"""Counting the bytes an engine holds, by kind and tier, each byte once."""
from typing import Dict, List, Tuple

import torch

KINDS = ("params", "fp32_master", "grads", "fp32_grads", "optimizer_state", "comm_buffers", "buffers",
         "hpz_secondary", "activations")
TIERS = ("accelerator", "host", "nvme")


class MemoryAccount:
    """Adds tensors under a kind; bytes already counted (views, aliases) are not counted again."""

    def __init__(self, compute_device: torch.device, host=()):
        self.compute_device = torch.device(compute_device)
        # tensors the engine placed in host memory (offloaded), whatever device they sit on
        self.host_storages = {(str(t.device), t.untyped_storage().data_ptr()) for t in host}
        self.bytes = {kind: {tier: 0 for tier in TIERS} for kind in KINDS}
        self.claimed: Dict[Tuple[str, int], List[Tuple[int, int]]] = {}  # storage -> byte ranges

    def tier_of(self, t: torch.Tensor) -> str:
        """The compute device's memory is the accelerator tier (on a CPU-only run too), the rest host."""
        same = t.device.type == self.compute_device.type and (
            self.compute_device.index is None or t.device.index == self.compute_device.index)
        return "accelerator" if same else "host"

    def add(self, kind: str, t: torch.Tensor, tier: str = None) -> None:
        if t is None or t.numel() == 0:
            return
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        key = (str(t.device), t.untyped_storage().data_ptr())
        ranges = self.claimed.setdefault(key, [])
        new = end - start - sum(max(0, min(end, b) - max(start, a)) for a, b in ranges)
        # the claimed ranges are kept disjoint, so the overlaps above add up exactly
        if new > 0:
            self._claim(ranges, start, end)
            if tier is None:
                tier = "host" if key in self.host_storages else self.tier_of(t)
            self.bytes[kind][tier] += new

    @staticmethod
    def _claim(ranges, start, end):
        """Adds [start, end) to the disjoint, sorted ranges, merging what touches."""
        merged = []
        for a, b in sorted(ranges + [(start, end)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        ranges[:] = merged

    def table(self) -> Dict[str, Dict[str, int]]:
        out = {kind: dict(tiers) for kind, tiers in self.bytes.items()}
        out["total"] = {tier: sum(self.bytes[k][tier] for k in KINDS) for tier in TIERS}
        return out
