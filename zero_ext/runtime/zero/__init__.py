"""DeepSpeed's ``deepspeed.runtime.zero`` import paths."""
