"""The ``aio`` section: asynchronous NVMe I/O used by NVMe offload.

Keys and defaults follow DeepSpeed's ``runtime/swap_tensor/constants.py`` (0.19.x).
DeepSpeed reads this section with plain ``dict.get`` (unknown keys silently ignored) and does not
read ``thread_count``, the name its config docs use; zero_ext checks keys like every other
section and accepts ``thread_count`` as an alias of ``intra_op_parallelism``.
"""

from __future__ import annotations

from pydantic import field_validator

from .base import ConfigModel, Int, option

#: The C aio engine's limits (csrc/aio.h): O_DIRECT alignment, bytes per request, requests in
#: flight per worker, workers per handle. Outside them the first NVMe swap would fail.
AIO_ALIGN, AIO_MAX_BLOCK, AIO_MAX_DEPTH, AIO_MAX_THREADS = 4096, 1 << 30, 4096, 64


class AioConfig(ConfigModel):
    """Tuning of the NVMe swap engine (only used with an "nvme" offload device)."""

    block_size: Int = option(1_048_576, "Bytes per I/O request: a multiple of 4096 (O_DIRECT).",
                             gt=0, le=AIO_MAX_BLOCK)
    queue_depth: Int = option(8, "I/O requests in flight per thread.", gt=0, le=AIO_MAX_DEPTH)
    intra_op_parallelism: Int = option(
        1, "I/O threads per swap operation (each request is split evenly between them).",
        ge=1, le=AIO_MAX_THREADS, aliases=("thread_count",),
        ds_note="DeepSpeed's docs call this thread_count, which its code ignores.")
    single_submit: bool = option(False, "Submit requests one at a time instead of batched.")
    overlap_events: bool = option(True, "Keep the queue full (reap and resubmit) instead of "
                                  "lock-step batches.")
    use_gds: bool = option(False, "Use NVIDIA GPUDirect Storage (CUDA only).")

    @field_validator("block_size")
    @classmethod
    def _aligned(cls, value: int) -> int:
        if value % AIO_ALIGN:
            raise ValueError(f"must be a multiple of {AIO_ALIGN} (O_DIRECT alignment)")
        return value
