"""DeepSpeed's ``deepspeed.utils`` names: ``zero_to_fp32`` (and, with the state-routines issue, safe_get_*)."""
from . import zero_to_fp32  # noqa: F401
