"""The ``aio`` section: asynchronous NVMe I/O used by NVMe offload.

Keys and defaults follow DeepSpeed's ``runtime/swap_tensor/constants.py`` (0.19.x).
DeepSpeed reads this section with plain ``dict.get`` (unknown keys silently ignored) and does not
read ``thread_count``, the name its config docs use; zero_ext checks keys like every other
section and accepts ``thread_count`` as an alias of ``intra_op_parallelism``.
"""

from __future__ import annotations

from .base import ConfigModel, Int, option


class AioConfig(ConfigModel):
    """Tuning of the NVMe swap engine (only used with an "nvme" offload device)."""

    block_size: Int = option(1_048_576, "Bytes per I/O request.", gt=0)
    queue_depth: Int = option(8, "I/O requests in flight per thread.", gt=0)
    intra_op_parallelism: Int = option(
        1, "I/O threads per swap operation (each request is split evenly between them).",
        ge=1, aliases=("thread_count",),
        ds_note="DeepSpeed's docs call this thread_count, which its code ignores.")
    single_submit: bool = option(False, "Submit requests one at a time instead of batched.")
    overlap_events: bool = option(True, "Keep the queue full (reap and resubmit) instead of "
                                  "lock-step batches.")
    use_gds: bool = option(False, "Use NVIDIA GPUDirect Storage (CUDA only).")
