"""``deepspeed.runtime.config_utils``."""
from zero_ext.runtime.config_utils import (DeepSpeedConfigModel, get_dict_param, get_list_param,  # noqa: F401
                                           get_scalar_param)
