"""``deepspeed.runtime.constants``: the config key names (and their defaults) that scripts and tests
spell with DeepSpeed's constants. Only the commonly imported ones; the keys themselves are documented in
docs/config.md."""
TRAIN_BATCH_SIZE, TRAIN_BATCH_SIZE_DEFAULT = "train_batch_size", None
TRAIN_MICRO_BATCH_SIZE_PER_GPU, TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = "train_micro_batch_size_per_gpu", None
GRADIENT_ACCUMULATION_STEPS, GRADIENT_ACCUMULATION_STEPS_DEFAULT = "gradient_accumulation_steps", None
OPTIMIZER, OPTIMIZER_PARAMS, OPTIMIZER_TYPE_DEFAULT, TYPE = "optimizer", "params", None, "type"
SCHEDULER, SCHEDULER_PARAMS, SCHEDULER_TYPE_DEFAULT = "scheduler", "params", None
MAX_GRAD_NORM = "max_grad_norm"
ZERO_ALLOW_UNTESTED_OPTIMIZER, ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT = "zero_allow_untested_optimizer", False
STEPS_PER_PRINT, STEPS_PER_PRINT_DEFAULT = "steps_per_print", None
GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT = "gradient_clipping", 1.0
FP16, FP16_ENABLED, FP16_ENABLED_DEFAULT = "fp16", "enabled", False
FP16_LOSS_SCALE, FP16_LOSS_SCALE_DEFAULT = "loss_scale", 0
FP16_INITIAL_SCALE_POWER, FP16_INITIAL_SCALE_POWER_DEFAULT = "initial_scale_power", 16
BFLOAT16, BFLOAT16_OLD, BFLOAT16_ENABLED, BFLOAT16_ENABLED_DEFAULT = "bf16", "bfloat16", "enabled", False
WALL_CLOCK_BREAKDOWN, WALL_CLOCK_BREAKDOWN_DEFAULT = "wall_clock_breakdown", False
LOG_LEVEL, LOG_LEVEL_DEFAULT = "log_level", None
