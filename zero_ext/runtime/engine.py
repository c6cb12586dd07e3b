"""``deepspeed.runtime.engine`` names."""
from ..engine import ZeroEngine

DeepSpeedEngine = ZeroEngine
