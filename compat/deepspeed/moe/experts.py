"""``deepspeed.moe.experts``: the local experts of an MoE layer, zero_ext.moe.layer's."""
from zero_ext.moe.layer import Experts  # noqa: F401
