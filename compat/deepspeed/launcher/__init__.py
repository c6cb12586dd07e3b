"""``deepspeed.launcher``."""
