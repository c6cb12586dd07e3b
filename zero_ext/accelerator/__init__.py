"""``get_accelerator()``: the small part of DeepSpeed's accelerator interface that libraries call.

DeepSpeed abstracts each device family (CUDA, XPU, HPU, CPU, ...) behind an accelerator object;
transformers and accelerate ask it for device names while loading weights under ZeRO-3. zero_ext runs
on CUDA or on the CPU, so there are two answers, chosen once: CUDA when torch sees a device, else CPU.
Only the methods third-party code is known to call are provided; anything else is an AttributeError
that names this file.
"""
import functools
from typing import Optional

import torch


class Accelerator:
    """The device zero_ext computes on: ``cuda`` (device LOCAL_RANK) or ``cpu``."""

    def __init__(self, name: str):
        self._name = name  # "cuda" or "cpu"

    def device_name(self, device_index: Optional[int] = None) -> str:
        """``"cuda"`` / ``"cuda:<i>"``, or ``"cpu"`` (the CPU has no index)."""
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"{self._name}:{int(device_index)}"

    def current_device_name(self) -> str:
        if self._name == "cpu":
            return "cpu"
        return f"cuda:{torch.cuda.current_device()}"

    def current_device(self):
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return True

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds CUDA devices too

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def __getattr__(self, name: str):
        raise AttributeError(f"zero_ext's accelerator (zero_ext/accelerator/) has no '{name}': only the part of "
                             "DeepSpeed's accelerator interface that libraries are known to call is provided")

    def __repr__(self) -> str:
        return f"<zero_ext accelerator {self._name}>"


@functools.lru_cache(maxsize=None)
def get_accelerator() -> Accelerator:
    """The process's accelerator (DeepSpeed's ``deepspeed.accelerator.get_accelerator``)."""
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")
