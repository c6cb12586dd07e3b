"""``deepspeed.runtime.zero.partition_parameters`` names."""
from ...zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter  # noqa: F401
from ...zero import unregister_external_parameter  # noqa: F401
