"""zero_ext.moe: DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``) with expert parallelism.

Files:
- groups.py: the expert-parallel and expert-data-parallel process groups of each ``ep_size`` (named
  ``ep_size_<n>``), their layouts, and the mpu's tensor-parallel groups as the layer reads them.
- gating.py: the router: top-1 / top-2 / top-k gating (capacity, drops, random token selection, noise,
  the load-balancing loss ``l_aux``, ``exp_counts``) and the gate module ``TopKGate``.
- dispatch.py: tokens into the experts' buffers and back, and the differentiable all-to-all over an
  expert-parallel group.
- mappings.py: tokens split over and gathered back from the mpu's tensor-parallel ranks.
- layer.py: ``MoE``, ``MOELayer`` and ``Experts``; the expert parameters' marks (``allreduce = False``,
  ``group_name``) that the engine reads.
- params.py: which parameters are experts (``is_moe_param``), and the optimizer groups they need
  (``split_params_into_different_moe_groups_for_optimizer``, DeepSpeed's ``deepspeed.moe.utils``).

docs/moe.md describes the layer, the groups and what the engine does with expert parameters.
"""
from . import groups  # noqa: F401
from .gating import TopKGate, top1gating, top2gating, topkgating  # noqa: F401
from .layer import MoE, MOELayer, Experts  # noqa: F401

__all__ = ["MoE", "MOELayer", "Experts", "TopKGate", "top1gating", "top2gating", "topkgating", "groups"]
