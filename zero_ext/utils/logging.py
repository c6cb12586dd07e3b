"""``deepspeed.utils.logging``: the module DeepSpeed's logger lives in. Lightning's DeepSpeedStrategy calls
``deepspeed.utils.logging.logger.setLevel(...)``; here ``logger`` is the ``zero_ext`` logger."""
import logging as _logging

logger = _logging.getLogger("zero_ext")

__all__ = ["logger"]
