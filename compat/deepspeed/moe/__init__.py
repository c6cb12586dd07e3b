"""``deepspeed.moe``: only ``deepspeed.moe.utils``'s optimizer-group splitter (zero_ext has no MoE layer)."""
from . import utils  # noqa: F401
