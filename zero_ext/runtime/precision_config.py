"""``deepspeed.runtime.precision_config``: the ``fp16`` / ``bf16`` sections of a config dict, validated.

``get_bfloat16_config(param_dict)`` reads ``bf16`` (or its older name ``bfloat16``),
``get_float16_config(param_dict)`` reads ``fp16``; each returns zero_ext's section model (BF16Config /
FP16Config: ``.enabled`` and the other keys DeepSpeed has), defaults when the section is absent.
"""
from typing import Any, Dict

from ..config.precision import BF16Config, FP16Config


def get_bfloat16_config(param_dict: Dict[str, Any]) -> BF16Config:
    if "bf16" in param_dict and "bfloat16" in param_dict:
        raise ValueError("the config gives both 'bf16' and its older name 'bfloat16'; keep one")
    return BF16Config(**(param_dict.get("bf16", param_dict.get("bfloat16")) or {}))


def get_float16_config(param_dict: Dict[str, Any]) -> FP16Config:
    return FP16Config(**(param_dict.get("fp16") or {}))


DeepSpeedBF16Config = BF16Config
DeepSpeedFP16Config = FP16Config

__all__ = ["get_bfloat16_config", "get_float16_config", "DeepSpeedBF16Config", "DeepSpeedFP16Config"]
