"""``deepspeed.runtime.zero.tiling`` names."""
from ...zero.tiling import TiledLinear, TiledLinearReturnBias  # noqa: F401
