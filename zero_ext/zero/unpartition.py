"""``zero_ext.zero.unpartition(module)``: make a ZeRO-3 model's parameters plain (whole) again.

After ``engine.destroy()`` a stage 3 model keeps its trained weights partitioned, as in DeepSpeed (the
model may not fit whole on one rank). When it does fit, ``unpartition`` gathers each parameter and
turns it back into an ordinary ``nn.Parameter`` with its full value and no ds_* attributes: the module
is then a plain PyTorch module (state_dict, deepcopy, a new engine of any stage). Collective: every rank
calls it, for the same module. One parameter is gathered at a time, so the peak is the whole model plus
the largest parameter.
"""
from typing import Iterable, Union

import torch

from .gathered import GatheredParameters
from .model import _INSTALLED
from .param import zero_param_of


def unpartition(module_or_params: Union[torch.nn.Module, Iterable[torch.nn.Parameter]]) -> None:
    """Gather every partitioned parameter of ``module_or_params`` and make it a plain parameter."""
    if isinstance(module_or_params, torch.nn.Module):
        if module_or_params in _INSTALLED:
            raise RuntimeError("zero_ext.zero.unpartition: this model still has ZeRO-3 hooks installed; call "
                               "engine.destroy() first (the engine would keep using the pieces)")
        params = list(module_or_params.parameters())
    else:
        params = list(module_or_params)
    unique = list({id(p): p for p in params}.values())  # a parameter may appear twice (tied weights)
    for p in unique:
        zp = zero_param_of(p)
        if zp is None:
            continue
        with GatheredParameters([p]):
            value = zp.full.detach().clone()
        zp.retire(value)
