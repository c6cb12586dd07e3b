"""``deepspeed.moe.layer``: the mixture-of-experts layer, zero_ext.moe.layer's (docs/moe.md)."""
from zero_ext.moe.layer import MoE  # noqa: F401
from zero_ext.moe.layer import Experts, MOELayer  # noqa: F401
from zero_ext.moe.gating import TopKGate  # noqa: F401

__all__ = ["MoE"]
