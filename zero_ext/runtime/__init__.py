"""DeepSpeed's ``deepspeed.runtime`` import paths, for code ported from DeepSpeed."""
