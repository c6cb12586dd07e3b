"""``deepspeed.moe.mappings``: tokens split over / gathered from the mpu's tensor-parallel ranks."""
from zero_ext.moe.mappings import _DropTokens, _GatherTokens, drop_tokens, gather_tokens  # noqa: F401
