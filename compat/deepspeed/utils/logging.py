"""``deepspeed.utils.logging``."""
from zero_ext.utils.logging import (get_current_level, get_log_level_from_string, logger,  # noqa: F401
                                    set_log_level_from_string, should_log_le)
