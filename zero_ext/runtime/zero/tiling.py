"""``deepspeed.runtime.zero.tiling`` names."""
from ...zero.tiling import TiledLinear  # noqa: F401
