"""DeepSpeed's ``deepspeed.runtime.zero`` import paths.

Files:
- partition_parameters.py: Init, GatheredParameters, ZeroParamStatus, external parameters.
- offload_config.py: OffloadDeviceEnum, OffloadStateTypeEnum; offload_states.py: get_state_devices.
- utils.py: is_zero_param.
"""
