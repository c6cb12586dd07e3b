"""``deepspeed.runtime.zero.tiling``."""
from zero_ext.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias  # noqa: F401
