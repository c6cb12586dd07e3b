"""zero_ext.comm: process groups and the checks that keep ranks in step.

Files:
- process_groups.py: ``init_distributed`` (DeepSpeed's signature) over torch.distributed, ranks, the
  collectives DeepSpeed's ``deepspeed.comm`` exposes.
- collective_check.py: every rank must call a collective API; one that does not fails with an
  explanation instead of hanging the others.
"""
from .process_groups import (DEFAULT_TIMEOUT_MINUTES, ReduceOp, add_config_arguments, all_gather,  # noqa: F401
                             all_gather_base, all_gather_into_tensor, all_reduce, all_to_all_single, barrier,
                             broadcast, default_backend, default_timeout, destroy_process_group, gather,
                             get_backend, get_global_rank, get_local_rank, get_process_group_ranks, get_rank,
                             get_world_group, get_world_size, init_distributed, irecv, is_initialized, isend,
                             new_group, recv, reduce, reduce_scatter, reduce_scatter_tensor, scatter, send)
