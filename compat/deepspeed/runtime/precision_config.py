"""``deepspeed.runtime.precision_config``."""
from zero_ext.runtime.precision_config import (DeepSpeedBF16Config, DeepSpeedFP16Config,  # noqa: F401
                                               get_bfloat16_config, get_float16_config)
