"""``deepspeed.utils.logging``: the module DeepSpeed's logger lives in. Lightning's DeepSpeedStrategy calls
``deepspeed.utils.logging.logger.setLevel(...)``; here ``logger`` is the ``zero_ext`` logger. The level
helpers take DeepSpeed's names ('debug', 'info', 'warning', 'error', 'critical'; any case), which is also
what the config's ``log_level`` accepts."""
import logging as _logging

logger = _logging.getLogger("zero_ext")

LOG_LEVELS = {"debug": _logging.DEBUG, "info": _logging.INFO, "warning": _logging.WARNING,
              "error": _logging.ERROR, "critical": _logging.CRITICAL}


def get_log_level_from_string(log_level_str: str) -> int:
    """'info' (any case) -> logging.INFO; ValueError naming the valid ones otherwise."""
    level = LOG_LEVELS.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"log level {log_level_str!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """Sets the level of ``custom_logger`` (default: the zero_ext logger) and of its handlers."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's effective level is at or below ``max_log_level_str``."""
    return get_current_level() <= get_log_level_from_string(max_log_level_str)


__all__ = ["logger", "get_log_level_from_string", "set_log_level_from_string", "get_current_level", "should_log_le"]
