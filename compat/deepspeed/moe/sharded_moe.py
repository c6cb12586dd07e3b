"""``deepspeed.moe.sharded_moe``: the gating functions, the gate, the MoE layer's core and its all-to-all,
all zero_ext.moe's. ``dist`` is zero_ext.comm itself, so a patch of ``sharded_moe.dist.<verb>`` is seen
by the gating code."""
from zero_ext import comm as dist  # noqa: F401
from zero_ext.moe.dispatch import _AllToAll, _route_slots, _sparse_decode, _sparse_encode  # noqa: F401
from zero_ext.moe.gating import (TopKGate, capacity, gumbel_rsample, multiplicative_jitter,  # noqa: F401
                                 top1gating, top2gating, topkgating)
from zero_ext.moe.layer import TUTEL_INSTALLED, MOELayer  # noqa: F401
