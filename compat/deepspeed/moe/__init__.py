"""``deepspeed.moe``: ``deepspeed.moe.utils``'s optimizer-group splitter; ``layer.MoE`` refuses (zero_ext has no MoE layer)."""
from . import layer, utils  # noqa: F401
