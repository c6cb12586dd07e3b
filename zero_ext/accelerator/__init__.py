"""``get_accelerator()``: the small part of DeepSpeed's accelerator interface that libraries call.

DeepSpeed abstracts each device family (CUDA, XPU, HPU, CPU, ...) behind an accelerator object;
transformers and accelerate ask it for device names while loading weights under ZeRO-3. zero_ext runs
on CUDA or on the CPU, so there are two answers, chosen once: CUDA when torch sees a device, else CPU.
Only the methods third-party code is known to call are provided; anything else is an AttributeError
that names this file.
"""
import functools
import os
import resource
from typing import Dict, List, Optional

import torch


def compute_device() -> torch.device:
    """The device this rank computes on. With CUDA: GPU LOCAL_RANK when the process sees one per local
    rank, the only GPU it sees when each rank is given its own (CUDA_VISIBLE_DEVICES per rank, as
    schedulers do); a LOCAL_RANK beyond several visible GPUs is an error naming both. Else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count, local = torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", "0") or 0)
    if count == 1:
        return torch.device("cuda", 0)
    if local < count:
        return torch.device("cuda", local)
    raise RuntimeError(f"LOCAL_RANK={local}, but this process sees {count} GPUs "
                       f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give each "
                       "rank one GPU, or let every rank see all of them")


class Accelerator:
    """The device zero_ext computes on: ``cuda`` (device LOCAL_RANK) or ``cpu``."""

    def __init__(self, name: str):
        self._name = name  # "cuda" or "cpu"
        self._peak = 0  # CPU: the largest resident set seen since the last reset

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
        # CPU: the device itself, which torch takes wherever a device goes (an index 0 would mean cuda:0;
        # DeepSpeed's CPU accelerator answers the LOCAL_RANK string, which torch takes nowhere)
        return torch.cuda.current_device() if self._name == "cuda" else "cpu"

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        """CUDA: the devices torch sees. CPU: the processes on this node (LOCAL_WORLD_SIZE, set by torchrun
        and zero-ext, or DeepSpeed's LOCAL_SIZE), else 1: each process is one CPU "device"."""
        if self._name == "cuda":
            return torch.cuda.device_count()
        for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            if int(os.environ.get(var, "0") or 0) > 0:
                return int(os.environ[var])
        return 1

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def supported_dtypes(self) -> List[torch.dtype]:
        """The floating dtypes zero_ext trains in on this device (fp32, fp16, and bf16 where supported)."""
        return [torch.float32, torch.float16] + ([torch.bfloat16] if self.is_bf16_supported() else [])

    # -- memory (CUDA: torch.cuda's allocator; CPU: this process's resident set, as DeepSpeed's CPU
    # accelerator reports it, with the peak since the last reset) ---------------------------------
    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        if self._name == "cuda":
            return torch.cuda.memory_allocated(device_index)
        return self._rss()

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        if self._name == "cuda":
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._peak

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else self._rss()

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._name == "cuda" else self.max_memory_allocated()

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak = 0
            self._rss()

    reset_max_memory_allocated = reset_peak_memory_stats

    def memory_stats(self, device_index: Optional[int] = None) -> Dict[str, int]:
        if self._name == "cuda":
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self._rss(), "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: Optional[int] = None) -> int:
        if self._name == "cuda":
            return torch.cuda.mem_get_info(device_index)[0]
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # not Linux: the peak the kernel reports (kilobytes on Linux/BSD, bytes on macOS)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._peak = max(self._peak, rss)
        return rss

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

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self._name == "cuda" else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self._name == "cuda":
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    def is_triton_supported(self) -> bool:
        return False  # zero_ext builds no triton kernels

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._name == "cuda" else False

    def is_synchronized_device(self) -> bool:
        """DeepSpeed's: whether work on this device runs in the caller's order (the CPU), i.e. has no streams."""
        return self._name != "cuda"

    # DeepSpeed's tensor constructors: FloatTensor([1.0]) makes an fp32 tensor on this device
    # (torch.tensor's semantics, as DeepSpeed's CUDA accelerator; its CPU one hands out torch's legacy types)
    BFloat16Tensor = property(lambda self: self._maker(torch.bfloat16))
    ByteTensor = property(lambda self: self._maker(torch.uint8))
    DoubleTensor = property(lambda self: self._maker(torch.float64))
    FloatTensor = property(lambda self: self._maker(torch.float32))
    HalfTensor = property(lambda self: self._maker(torch.float16))
    IntTensor = property(lambda self: self._maker(torch.int32))
    LongTensor = property(lambda self: self._maker(torch.int64))

    def _maker(self, dtype: torch.dtype):
        return functools.partial(torch.tensor, dtype=dtype, device=self.device_name())

    def __getattr__(self, name: str):
        raise AttributeError(f"zero_ext's accelerator (zero_ext/accelerator/) has no '{name}': only the part of "
                             "DeepSpeed's accelerator interface that libraries are known to call is provided")

    def __repr__(self) -> str:
        return f"<zero_ext accelerator {self._name}>"


@functools.lru_cache(maxsize=None)
def get_accelerator() -> Accelerator:
    """The process's accelerator (DeepSpeed's ``deepspeed.accelerator.get_accelerator``)."""
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's check that the process's accelerator is one it supports: zero_ext's are CUDA and the CPU,
    both on DeepSpeed's list."""
    return get_accelerator().device_name() in ("cuda", "cpu")
