"""Mixed precision that is neither a ZeRO stage nor the optimizer: DeepSpeed's ``torch_autocast``.

Files:
- autocast.py: the forward under torch.autocast (autocast_if_enabled), the ``comm_dtype`` attribute of
  the lower-precision-safe modules' parameters (init_autocast_params) and the dtype each parameter's
  gradient is reduced and, at ZeRO-3, all-gathered in (get_comm_dtype, get_allgather_dtype).
"""
