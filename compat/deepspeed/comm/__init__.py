"""``deepspeed.comm``: zero_ext.comm (init_distributed, ranks, and torch.distributed's collectives)."""
from zero_ext.comm import (ReduceOp, all_gather, all_reduce, barrier, broadcast, get_local_rank,  # noqa: F401
                           get_rank, get_world_size, init_distributed, is_initialized)
