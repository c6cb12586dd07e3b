"""``deepspeed.zero``: zero_ext.zero (Init, GatheredParameters, external parameters, leaf modules, ...)."""
from zero_ext.zero import *  # noqa: F401,F403
from zero_ext.zero import __all__  # noqa: F401
