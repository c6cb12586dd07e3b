"""DeepSpeed's ``deepspeed.runtime.zero.mics`` import path: MiCS_Init (zero/init.py; zero/mics.py)."""
from ...zero import MiCS_Init  # noqa: F401
