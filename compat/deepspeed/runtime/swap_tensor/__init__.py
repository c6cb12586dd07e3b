"""``deepspeed.runtime.swap_tensor``: DeepSpeed's smallest swapped tensor size. Code sizes test models with it
so that NVMe offload has something to swap; zero_ext swaps pieces of any size (in ``aio.block_size`` blocks,
1 MiB by default), so the value is DeepSpeed's and changes nothing here."""
MIN_SWAPPABLE_BYTES = 1024**2

__all__ = ["MIN_SWAPPABLE_BYTES"]
