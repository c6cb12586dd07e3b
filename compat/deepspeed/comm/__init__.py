"""``deepspeed.comm``: zero_ext.comm (init_distributed, ranks, groups, and torch.distributed's collectives)."""
from zero_ext.comm import (ReduceOp, all_gather, all_gather_base, all_gather_into_tensor, all_reduce,  # noqa: F401
                           all_to_all_single, barrier, broadcast, destroy_process_group, gather, get_backend,
                           get_global_rank, get_local_rank, get_process_group_ranks, get_rank, get_world_group,
                           get_world_size, init_distributed, irecv, is_initialized, isend, new_group, recv,
                           reduce, reduce_scatter, reduce_scatter_tensor, scatter, send)
