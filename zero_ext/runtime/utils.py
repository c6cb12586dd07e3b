"""``deepspeed.runtime.utils``: ``see_memory_usage``, the memory printout scripts sprinkle through their
training loops. The rest of DeepSpeed's module (gradient-norm and overflow helpers over its own
optimizer internals, pipeline partitioning) has no counterpart here: zero_ext's engine does that work
itself."""
import logging

from ..accelerator import get_accelerator
from ..comm import get_rank, is_initialized

logger = logging.getLogger("zero_ext")

_GB = 1024 ** 3


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force``, logs (at INFO, rank 0 only) ``message``, the accelerator's allocated / peak / reserved
    memory in GB and the host's used virtual memory, then resets the accelerator's peak counters.
    Without ``force`` it does nothing, as DeepSpeed's."""
    if not force or (is_initialized() and get_rank() != 0):
        return
    acc = get_accelerator()
    logger.info(message)
    logger.info("MA %.2f GB  Max_MA %.2f GB  CA %.2f GB  Max_CA %.2f GB", acc.memory_allocated() / _GB,
                acc.max_memory_allocated() / _GB, acc.memory_reserved() / _GB, acc.max_memory_reserved() / _GB)
    try:
        import psutil
    except ImportError:  # (not a dependency: the host line is left out without it)
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        logger.info("CPU Virtual Memory:  used = %.2f GB, percent = %s%%", (vm.total - vm.available) / _GB, vm.percent)
    acc.reset_peak_memory_stats()


__all__ = ["see_memory_usage"]
