"""``deepspeed.runtime.zero.leaf_module_config``: the ``leaf_module`` section of zero_optimization and its defaults."""
from zero_ext.config.zero_extras import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig  # noqa: F401

DEFAULT_LEAF_MODULE_NAMES = []  # (DeepSpeed's defaults: no names, no suffixes)
DEFAULT_LEAF_MODULE_NAME_SUFFIXES = []
DeepSpeedZeroLeafModuleConfig = LeafModuleConfig
