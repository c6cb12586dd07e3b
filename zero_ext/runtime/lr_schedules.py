"""``deepspeed.runtime.lr_schedules`` names: DeepSpeed's five schedulers and the list of their names
(accelerate tells a DeepSpeed scheduler from others by ``type(s).__name__ in VALID_LR_SCHEDULES``)."""
from ..optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR  # noqa: F401

LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

# the parameter names of their config "params" (DeepSpeed's constants)
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = "cycle_second_step_size", "cycle_second_stair_count"
DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "decay_step_size", "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE = "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS = "warmup_min_ratio", "cos_min_ratio", "total_num_steps"
