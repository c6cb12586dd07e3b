"""``deepspeed.moe.layer``: DeepSpeed's mixture-of-experts layer is not in zero_ext (no expert parallelism).
The name exists so that modules importing it load; building one refuses."""
import torch


class MoE(torch.nn.Module):
    """DeepSpeed's MoE layer: not in zero_ext."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("deepspeed.moe.layer.MoE: zero_ext has no mixture-of-experts layer (no expert "
                                  "parallelism); use a model's own MoE module, trained as ordinary parameters")


__all__ = ["MoE"]
