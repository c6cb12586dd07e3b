"""zero_ext.comm: process groups, the collective facade, and the checks that keep ranks in step.

Files:
- process_groups.py: ``init_distributed`` (DeepSpeed's signature) over torch.distributed, ranks and
  groups.
- collectives.py: the collective facade: every collective zero_ext runs (and deepspeed.comm's names),
  each routed to the native transport or to torch.distributed.
- native.py: the native shared-memory transport (csrc/comm.h) for CPU tensors of ranks on one host.
- nccl.py: the NCCL transport (csrc/comm_nccl.c through _native/cuda.py) for CUDA tensors; unverified
  on a GPU.
- fragments.py: one parameter's fragments across ranks (csrc/comm_state.c): the gather, scatter and
  local copies under utils/safe_state.py.
- outstanding.py: the tensors of torch.distributed collectives still held by its backend threads, kept
  until they let go (``settle`` after a step, ``drain`` at exit): see [Note: the exit race] there.
- collective_check.py: every rank must call a collective API; one that does not fails with an
  explanation instead of hanging the others.
- departures.py: a rank that leaves says why in the store, so the others' failed torch.distributed
  collectives raise a CommError naming it.
- mpu.py: DeepSpeed's ``mpu`` argument read once: the data- and model-parallel groups.
- traffic.py: the bytes the facade's collectives send, in all and across nodes (off unless started).
"""
from .collectives import (ReduceOp, all_gather, all_gather_base, all_gather_coalesced,  # noqa: F401
                          all_gather_into, all_gather_into_tensor, all_gather_object, all_gather_v, all_reduce, all_to_all_single, barrier, broadcast, gather,
                          gather_object, irecv, isend, recv, reduce, reduce_scatter, reduce_scatter_fn, reduce_scatter_tensor,
                          scatter, send)
from .outstanding import drain, pending, settle  # noqa: F401
from .process_groups import (DEFAULT_TIMEOUT_MINUTES, add_config_arguments, default_backend,  # noqa: F401
                             default_timeout, destroy_process_group, get_backend, get_global_rank,
                             get_local_rank, get_process_group_ranks, get_rank, get_world_group, get_world_size,
                             init_distributed, is_initialized, new_group)
from .native import CommError, transport  # noqa: F401
