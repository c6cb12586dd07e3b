"""``deepspeed.moe``: the mixture-of-experts layer (zero_ext.moe): ``layer.MoE``, ``sharded_moe``, ``experts``,
``mappings``, and ``utils``' expert-parameter test and optimizer-group splitter."""
from . import experts, layer, mappings, sharded_moe, utils  # noqa: F401
