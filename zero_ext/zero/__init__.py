"""ZeRO-3's parameter layer: partitioned parameters and everything that gathers them.

    import zero_ext as deepspeed
    with deepspeed.zero.Init():                      # parameters partitioned as modules are built
        model = MyModel()
    with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        ...                                          # full values inside, rank 0's changes kept
    zm = deepspeed.zero.ZeroModel(model)             # gather/release around every forward/backward

Files, one noun each (docs/zero3.md has the design):
- status.py: the enums (ZeroParamStatus, TrainingPhase, FetchKind, TraceState).
- param.py: ZeroParam, the one owner of a partitioned parameter; guard.py: the class a partitioned
  parameter takes, which refuses in-place writes (PartitionedWriteError).
- collectives.py: the gathers and scatters, as free functions; quantized_gather.py: ZeRO++ qwZ's int8 gather;
  secondary.py: ZeRO++ hpZ's node-local copies and their gathers; quantized_pieces.py: frozen pieces
  kept as int8 (zero_quantized_nontrainable_weights).
- fetch.py: fetch/release and the fetch-order agreement between ranks.
- convert.py: whole -> partitioned (zero.Init, ZeroModel).
- linear.py: DeepSpeed's LinearModuleForZeroStage3 (autocast-aware Linear; never swapped in).
- mics.py: MiCS's shard, replica and node groups (mics_shard_size), the registry naming a shard group's
  layout.
- init.py: zero.Init and zero.MiCS_Init; materialise.py: its torch calls on the full value of partitioned parameters.
- model.py: ZeroModel, the layer installed on one model.
- hooks.py: the per-module forward/backward hooks.
- coordinator.py: prefetch along the recorded fetch order; trace.py: that order (FetchEvent, Trace);
  resident.py: decoding with the whole model kept gathered, checked on a doubling schedule;
  streaming.py: decoding of a model over max_live_parameters, the check carried in the gathers' stamps;
  streaming_forward.py: the coordinator's streaming forwards (their fences);
  meter.py: GatherMeter, the elements gathered now and at most.
- external.py: external parameters; gathered.py: GatheredParameters; generation.py: ``generation``, the
  whole model gathered for generation after a memory check; ds_surface.py: DeepSpeed's hook surface
  (``parameter_offload``, ``ds_external_parameters``) that TRL uses; ds_param_methods.py: DeepSpeed's
  ``param.all_gather()`` / ``all_gather_coalesced()`` / ``partition()`` and their handles; leaf.py: leaf modules;
  tiling.py: TiledLinear, TiledLinearReturnBias; unpartition.py: ``unpartition``.
- tree.py: tensors inside a module's inputs and outputs; internal.py: zero_ext's own tensor work,
  hidden from its TorchFunctionModes.
- utils.py: DeepSpeed's ``deepspeed.runtime.zero.utils`` names.
- linear.py: DeepSpeed's ZeRO-3 linear function (zero3_linear_wrap), which zero_ext's models do not need.
"""
from .convert import partition_module
from .external import register_external_parameter, unregister_external_parameter
from .fetch import FetchOrderError
from .gathered import GatheredParameters
from .generation import GenerationMemoryError, generation
from .guard import PartitionedWriteError
from .init import Init, MiCS_Init
from .model import ZeroModel
from .param import ZeroParam, is_zero_param, zero_param_of
from .status import TrainingPhase, ZeroParamStatus
from .leaf import (get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module,
                   z3_leaf_parameter)
from .tiling import TiledLinear, TiledLinearReturnBias
from .unpartition import unpartition

__all__ = [
    "Init", "MiCS_Init", "GatheredParameters", "unpartition", "register_external_parameter", "unregister_external_parameter",
    "ZeroParamStatus", "is_zero_param", "ZeroParam", "zero_param_of", "ZeroModel", "FetchOrderError",
    "TrainingPhase", "partition_module", "TiledLinear", "TiledLinearReturnBias", "set_z3_leaf_modules",
    "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter", "PartitionedWriteError", "generation",
    "GenerationMemoryError",
]
