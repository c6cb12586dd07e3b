"""zero_ext.offload: where host memory comes into play (ZeRO-Offload) and how bytes are counted.

Files:
- plan.py: OffloadPlan (what ``offload_optimizer`` / ``offload_param`` decide) and HostMemory (the
  engine's host-tier tensors).
- host_buffers.py: how large host tensors are allocated (page-aligned, huge pages, cache colours,
  pinned).
- states.py: ``engine.offload_states()`` / ``reload_states()`` and DeepSpeed's enums for them.
- memory.py: MemoryAccount, the bytes an engine holds by kind and tier, each byte once.
"""
