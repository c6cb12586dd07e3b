"""``deepspeed.runtime.zero``."""
from zero_ext.zero import GatheredParameters, Init, register_external_parameter  # noqa: F401
from . import partition_parameters  # noqa: F401
