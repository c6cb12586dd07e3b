"""DeepSpeed's ``deepspeed.runtime`` import paths, for code ported from DeepSpeed (names only; the code
is where the layer map in docs/design.md puts it).

Files:
- engine.py: ``deepspeed.runtime.engine`` (DeepSpeedEngine).
- config.py: ``deepspeed.runtime.config`` (DeepSpeedConfig over zero_ext.config; the optimizer type names, get_log_level).
- eigenvalue.py: DeepSpeedConfig's ``eigenvalue_*`` attributes (MoQ's settings, DeepSpeed's defaults).
- constants.py: ``deepspeed.runtime.constants`` (config key names and defaults scripts spell with them).
- config_utils.py: ``deepspeed.runtime.config_utils`` (DeepSpeedConfigModel, the base of config sections).
- precision_config.py: ``deepspeed.runtime.precision_config`` (get_bfloat16_config, get_float16_config).
- torch_autocast.py: ``deepspeed.runtime.torch_autocast`` (the torch_autocast names, precision/autocast.py).
- lr_schedules.py: ``deepspeed.runtime.lr_schedules`` (the five schedulers, VALID_LR_SCHEDULES).
- utils.py: ``deepspeed.runtime.utils`` (see_memory_usage; its gradient helpers are utils/runtime_utils.py).
- zero/: ``deepspeed.runtime.zero`` and its modules.
"""
