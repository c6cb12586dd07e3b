"""``deepspeed.runtime.zero.partition_parameters``."""
from zero_ext.runtime.zero.partition_parameters import (AllGatherCoalescedHandle, GatheredParameters,  # noqa: F401
                                                        Init, MultipleAllGatherHandles, ZeroParamStatus,
                                                        _contradicting_single_rank_pg_error, _orig_torch_arange,
                                                        _orig_torch_empty, get_accelerator,
                                                        get_allgather_dtype,
                                                        partitioned_param_data_shape, register_external_parameter,
                                                        unregister_external_parameter,
                                                        zero_wrapper_for_fp_tensor_constructor)
