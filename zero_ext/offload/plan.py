"""ZeRO-Offload: what the ``offload_optimizer`` / ``offload_param`` sections decide, in one place.

- :class:`HostMemory` allocates the host-tier tensors of an offloaded engine (pinned when CUDA is
  present and ``pin_memory`` asks for it: page-locked memory makes the device copies asynchronous).
- :class:`OffloadPlan` reads the config: which sub-groups' optimizer step runs on the host
  (``ratio``), whether parameter pieces live on the host.

On a CPU-only machine "host" and "accelerator" are the same memory, so the offloaded code path runs
there unchanged (host-to-host copies) — that is what the test suite exercises. The engine tells the
memory account which tensors it placed on the host, so ``memory_breakdown()`` reports the tiers as
they would be on a GPU machine.
"""
from typing import List, Optional

import torch

from .host_buffers import host_empty


class HostMemory:
    """Allocates the engine's host-tier tensors and remembers them (for the memory account)."""

    def __init__(self, pin_memory: bool):
        self.pin = bool(pin_memory) and torch.cuda.is_available()
        self._tensors: List[torch.Tensor] = []

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """host_buffers.host_empty, zeroed: pinned (CUDA page-locked) with pin_memory, else on huge
        pages; from 2 MiB up on its own cache colour either way."""
        t = host_empty(numel, dtype, pin_memory=self.pin).zero_()
        self._tensors.append(t)
        return t

    def copy_of(self, src: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A host copy of ``src`` (flat) in ``dtype`` — always a new tensor, never a view of src."""
        t = self.zeros(src.numel(), dtype)
        t.copy_(src.reshape(-1))
        return t

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """Records a host tensor made elsewhere (the optimizer's state) as host-tier."""
        self._tensors.append(t)
        return t

    def tensors(self) -> List[torch.Tensor]:
        return list(self._tensors)


def _device_name(section) -> str:
    return "none" if section is None else str(getattr(section.device, "value", section.device))


class OffloadPlan:
    """The offload decisions of one engine (``zero_optimization`` config section)."""

    def __init__(self, zero_config):
        opt, par = zero_config.offload_optimizer, zero_config.offload_param
        self.optimizer_device = _device_name(opt)  # "none", "cpu" or "nvme"
        self.param_device = _device_name(par) if zero_config.stage == 3 else "none"  # (ignored below stage 3)
        self.ratio = float(opt.ratio) if opt is not None else 1.0
        pin = (opt is not None and opt.pin_memory) or (par is not None and par.pin_memory)
        self.host = HostMemory(pin)

    @property
    def optimizer(self) -> bool:
        """Whether the optimizer step (fp32 masters, gradients, state) runs in host memory."""
        return self.optimizer_device != "none"

    @property
    def params(self) -> bool:
        """Stage 3: whether parameter pieces live in host memory between uses."""
        return self.param_device != "none"

    @property
    def param_remote_device(self) -> Optional[str]:
        return "cpu" if self.params else None

    def host_subgroups(self, numels: List[int]) -> List[bool]:
        """Which sub-groups are stepped on the host: all with ratio 1; with ratio < 1 the leading
        sub-groups while their elements stay within ratio × the total (at least one when ratio > 0),
        the rest on the accelerator. Whole sub-groups, so each one's state lives in one place."""
        if not self.optimizer:
            return [False] * len(numels)
        if self.ratio >= 1.0:
            return [True] * len(numels)
        budget, total, out = self.ratio * sum(numels), 0, []
        for n in numels:
            take = total + n <= budget or (not out and self.ratio > 0)
            if take and (not out or out[-1]):
                total += n
                out.append(True)
            else:
                out.append(False)
        return out
