"""zero_ext.nvme: ZeRO-Infinity's NVMe tier: swap files written and read through io_uring.

Files:
- aio.py: AsyncIO (one ``_C.AioHandle``: io_uring or the thread pool), SwapFile, AioRequest, AioError.
- swap_dir.py: ``check_nvme_path`` and SwapDir (the per-run directory, and reaping of crashed runs').
- swapper.py: NVMeSwapper, whole tensors swapped by name.
- store.py: NVMeStateStore, groups of tensors (fp32 masters, optimizer state) in swap files, streamed
  through a pool of host buffers.
- groups.py: the store's records (SwapState, a group and its swap files, spare slots, a pool buffer).
- pieces.py: NVMePieces, ZeRO-3's 16-bit parameter pieces in swap files (``offload_param: nvme``).
"""
