"""TiledLinear: a Linear cut into a grid of smaller Linears, so ZeRO-3 gathers one tile at a time.

A huge projection gathered whole may not fit; as tiles, each is its own module, fetched before its
forward and released after, so the live set is one tile. ``in_splits`` cuts the input features,
``out_splits`` the output features (each part ``n // splits`` wide, the last taking the remainder, as
DeepSpeed's partition_uniform); the bias sits on the tiles of the last input part only, so it is added
once. The result equals the whole Linear's up to the order of the sums (split-K).
"""
from typing import List, Optional, Sequence, Union

import torch
from torch import nn

from .gathered import GatheredParameters


def _cuts(n: int, parts: int) -> List[int]:
    if not 1 <= parts <= n:
        raise ValueError(f"TiledLinear: cannot cut {n} features into {parts} parts (need 1 <= parts <= {n})")
    size = n // parts
    return [size] * (parts - 1) + [n - size * (parts - 1)]


class TiledLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls=nn.Linear, init_linear: Optional[nn.Linear] = None, **kwargs):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.in_parts, self.out_parts = _cuts(in_features, in_splits), _cuts(out_features, out_splits)
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.linears = nn.ModuleList([
            nn.ModuleList([linear_cls(fin, fout, bias=bias and i == in_splits - 1, **kwargs)
                           for i, fin in enumerate(self.in_parts)])
            for fout in self.out_parts])
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Union[torch.Tensor, Sequence[torch.Tensor]]):
        if self.input_is_already_split:
            if len(input_) != self.in_splits:
                raise ValueError(f"TiledLinear: expected {self.in_splits} input parts, got {len(input_)}")
            inputs = list(input_)
        else:
            inputs = torch.split(input_, self.in_parts, dim=-1)
        outputs = []
        for row in self.linears:
            acc = None
            for tile, x in zip(row, inputs):
                y = tile(x)
                acc = y if acc is None else acc + y
            outputs.append(acc)
        return torch.cat(outputs, dim=-1) if self.combine_out_splits else outputs

    @torch.no_grad()
    def copy_params_from(self, other: nn.Linear) -> None:
        """Copies a whole Linear's weight (and bias) into the tiles; under ZeRO-3 both sides are gathered
        and rank 0's values are kept (so it works on partitioned modules, from any rank's source)."""
        if tuple(getattr(other.weight, "ds_shape", other.weight.shape)) != (self.out_features, self.in_features):
            raise ValueError(f"TiledLinear.copy_params_from: weight of shape {tuple(other.weight.shape)}, expected "
                             f"({self.out_features}, {self.in_features})")
        src = [other.weight] + ([other.bias] if other.bias is not None else [])
        with GatheredParameters(src):
            row_start = 0
            for fout, row in zip(self.out_parts, self.linears):
                col_start = 0
                for fin, tile in zip(self.in_parts, row):
                    dst = [tile.weight] + ([tile.bias] if tile.bias is not None else [])
                    with GatheredParameters(dst, modifier_rank=0):
                        tile.weight.copy_(other.weight[row_start:row_start + fout, col_start:col_start + fin])
                        if tile.bias is not None:
                            tile.bias.copy_(other.bias[row_start:row_start + fout])
                    col_start += fin
                row_start += fout
