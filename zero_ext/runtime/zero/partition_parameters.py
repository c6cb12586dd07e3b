"""``deepspeed.runtime.zero.partition_parameters`` names."""
import torch

from ...accelerator import get_accelerator  # noqa: F401
from ...precision.autocast import get_allgather_dtype  # noqa: F401
from ...zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter  # noqa: F401
from ...zero import unregister_external_parameter  # noqa: F401
from ...zero.ds_param_methods import AllGatherCoalescedHandle, MultipleAllGatherHandles  # noqa: F401
from ...zero.convert import single_rank_group_error as _contradicting_single_rank_pg_error  # noqa: F401

# transformers' prevent_arange_dtype_change() swaps zero_wrapper_for_fp_tensor_constructor for the
# length of a zero.Init, so that DeepSpeed's tensor-constructor override leaves torch.arange's dtype
# alone. zero_ext's Init casts only floating-point factory results to its dtype (see zero/init.py) and
# never calls this name, so the swap has nothing to change: both names exist for that code to run.
_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty  # (the same, for code that swaps torch.empty's DeepSpeed override)


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """Unused by zero_ext (see above); returns ``fn`` unchanged."""
    return fn


#: The shape of a partitioned parameter's own ``.data`` (its piece is ``ds_tensor``): empty, as in DeepSpeed.
partitioned_param_data_shape = [0]
