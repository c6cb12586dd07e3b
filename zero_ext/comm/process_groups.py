"""Process groups: ``init_distributed`` (DeepSpeed's signature) over torch.distributed.

The distributed engine is torch.distributed, never a home-made one: gloo on CPU, and with CUDA the
backend ``cpu:gloo,cuda:nccl`` (offloaded host tensors need CPU collectives too).
"""
import datetime
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from . import departures
from .outstanding import drain

logger = logging.getLogger("zero_ext.comm")

# DeepSpeed's default collective timeout since 0.19.6 (was 30 minutes): a dead rank must not hang the
# others for long. DEEPSPEED_TIMEOUT (minutes) overrides it, and so does the `timeout` argument.
DEFAULT_TIMEOUT_MINUTES = 10
# Open MPI and MPICH/Intel MPI spell rank, size and local rank differently.
MPI_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


def default_timeout() -> datetime.timedelta:
    """The collective timeout: DEEPSPEED_TIMEOUT minutes if set, else 10 minutes."""
    raw = os.environ.get("DEEPSPEED_TIMEOUT")
    if raw is None or raw == "":
        return datetime.timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)
    try:
        minutes = float(raw)
    except ValueError:
        raise ValueError(f"DEEPSPEED_TIMEOUT={raw!r} is not a number of minutes; unset it or write e.g. 10") from None
    if minutes <= 0:
        raise ValueError(f"DEEPSPEED_TIMEOUT={raw!r} must be a positive number of minutes")
    return datetime.timedelta(minutes=minutes)


def default_backend() -> str:
    """gloo without CUDA; ``cpu:gloo,cuda:nccl`` with it."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _discover_mpi(distributed_port: int, verbose: bool) -> bool:
    """Sets torchrun's variables from an MPI launcher's, as DeepSpeed's auto_mpi_discovery does.

    MASTER_ADDR cannot be learned without an MPI library (DeepSpeed broadcasts rank 0's hostname with
    mpi4py); here it must be given, and its absence is an error that says so.
    """
    for rank_var, size_var, local_var in MPI_VARIABLES:
        if rank_var in os.environ and size_var in os.environ:
            break
    else:
        return False
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError(
            f"init_distributed: found an MPI launch ({rank_var}={os.environ[rank_var]}) but no MASTER_ADDR; "
            "zero_ext does not query MPI for rank 0's address. Export MASTER_ADDR (rank 0's host name) "
            "and MASTER_PORT, or launch with torchrun.")
    os.environ["RANK"] = os.environ[rank_var]
    os.environ["WORLD_SIZE"] = os.environ[size_var]
    os.environ.setdefault("LOCAL_RANK", os.environ.get(local_var, "0"))
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if verbose:
        logger.info("init_distributed: MPI discovery: rank %s of %s", os.environ["RANK"], os.environ["WORLD_SIZE"])
    return True


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: Optional[datetime.timedelta] = None, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialise torch.distributed the way DeepSpeed does.

    - Already initialised: nothing to do (``dist_init_required=False`` also skips initialisation).
    - torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK) set, or ``rank`` and
      ``world_size`` given: env:// initialisation (``init_method`` overrides env://).
    - An MPI launch (Open MPI / MPICH variables) with ``auto_mpi_discovery``: its rank and size are used;
      MASTER_ADDR must be exported (see _discover_mpi).
    - Nothing set: a single-process group (world size 1) on an in-memory store, so scripts and notebooks
      run unchanged on one process without picking a port.

    The backend defaults to gloo, or ``cpu:gloo,cuda:nccl`` when CUDA is present; the collective timeout
    to 10 minutes (``DEEPSPEED_TIMEOUT`` in minutes, or ``timeout``). ``config`` is accepted for
    DeepSpeed compatibility (it configures DeepSpeed's comms logger, which zero_ext does not have).
    """
    if dist.is_initialized():
        if verbose:
            logger.debug("init_distributed: torch.distributed is already initialised; nothing to do")
        return
    if dist_init_required is False:
        return
    backend = dist_backend or default_backend()
    timeout = timeout if timeout is not None else default_timeout()
    if rank >= 0 and world_size < 1 or world_size >= 1 and rank < 0:
        raise ValueError(f"init_distributed: give both rank and world_size, or neither (got rank={rank}, "
                         f"world_size={world_size})")
    if rank >= 0 and rank >= world_size:
        raise ValueError(f"init_distributed: rank {rank} is out of range for world_size {world_size}")
    launched = rank >= 0 or ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or (
        auto_mpi_discovery and _discover_mpi(distributed_port, verbose))
    if not launched and init_method is None:
        return _init_single_process(backend, timeout, verbose)
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        init_method = "env://"
    kwargs = dict(backend=backend, init_method=init_method, timeout=timeout)
    if rank >= 0:
        kwargs.update(rank=rank, world_size=world_size)
    if "cuda" in backend and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(**kwargs)
    departures.forget()
    if verbose:
        logger.info("init_distributed: rank %d of %d, backend %s, timeout %s", dist.get_rank(),
                    dist.get_world_size(), backend, timeout)


def _init_single_process(backend: str, timeout: datetime.timedelta, verbose: bool) -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if "cuda" in backend:
        torch.cuda.set_device(0)
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if verbose:
        logger.info("init_distributed: no launcher variables found; single-process group (world size 1, %s)",
                    backend)


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (default: the world); 0 before init_distributed."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    """The ranks in ``group`` (default: the world); 1 before init_distributed."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


# DeepSpeed's ``deepspeed.comm`` also re-exports torch.distributed's calls; libraries (transformers,
# accelerate) use these few. They are torch.distributed's own, on the default group.
is_initialized = dist.is_initialized
new_group = dist.new_group
get_process_group_ranks = dist.get_process_group_ranks


def destroy_process_group(group=None) -> None:
    """torch.distributed's, after the backend has let go of every tensor of zero_ext's collectives
    (outstanding.drain; see [Note: the exit race]) and the native communicators of the groups that go
    are destroyed (all for None)."""
    from . import native, nccl  # native imports this module for default_timeout (nccl imports native)

    if group is None:
        departures.announce("it ended its process group (destroy_process_group)")
    drain()
    native.destroy_all() if group is None else native.destroy_group(group)
    nccl.destroy_all() if group is None else nccl.destroy_group(group)
    dist.destroy_process_group(group)


get_backend = dist.get_backend


def get_world_group():
    """The default (world) process group (``deepspeed.comm.get_world_group``)."""
    return dist.group.WORLD


def get_global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (``deepspeed.comm.get_global_rank``)."""
    return dist.get_global_rank(group, group_rank)


def add_config_arguments(parser):
    """DeepSpeed's command-line arguments (--deepspeed, --deepspeed_config, and the deprecated
    --deepscale / --deepscale_config), so scripts written for DeepSpeed parse unchanged."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (zero_ext)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code; no effect in zero_ext)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated: enable DeepSpeed (use --deepspeed)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated: DeepSpeed json configuration file (use --deepspeed_config)")
    return parser
