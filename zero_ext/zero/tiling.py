"""TiledLinear: a Linear cut into a grid of smaller Linears, so ZeRO-3 gathers one tile at a time.

A huge projection gathered whole may not fit; as tiles, each is its own module, fetched before its
forward and released after, so the live set is one tile. ``in_splits`` cuts the input features,
``out_splits`` the output features. The layout is DeepSpeed's, so state dicts and checkpoints of tiled
models are interchangeable: ``in_parts`` / ``out_parts`` are boundaries ``[0, b1, ..., n]`` (part ``i``
is ``[parts[i], parts[i+1])``), each part ``n // splits`` wide and the first ``n % splits`` parts one
wider; the bias sits on the tiles of the last input part only, so it is added once. The result equals
the whole Linear's up to the order of the sums (split-K).

Subclasses change how tiles combine through ``_split_global_input``, ``_reduce_local_output`` and
``_combine_output_splits`` (TiledLinearReturnBias: tiles that return ``(output, bias)``).
"""
from typing import Any, List, Optional, Sequence, Union

import torch
from torch import nn

from .gathered import GatheredParameters


class TilingError(ValueError, RuntimeError):
    """A TiledLinear that cannot be built (splits out of range, a source Linear of another shape). A
    ValueError, and the RuntimeError DeepSpeed raises for bad splits."""


def _boundaries(n: int, parts: int, what: str) -> List[int]:
    if not 1 <= parts <= n:
        raise TilingError(f"TiledLinear: cannot cut {n} {what} features into {parts} parts (need 1 <= parts <= {n})")
    size, extra = divmod(n, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + size + (1 if i < extra else 0))
    return out


def _widths(bounds: Sequence[int]) -> List[int]:
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


class TiledLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls=nn.Linear, init_linear: Optional[nn.Linear] = None, **kwargs):
        super().__init__()
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_parts = _boundaries(in_features, in_splits, "input")
        self.out_parts = _boundaries(out_features, out_splits, "output")
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.linears = nn.ModuleList([
            nn.ModuleList([linear_cls(fin, fout, bias=bias and i == in_splits - 1, **kwargs)
                           for i, fin in enumerate(_widths(self.in_parts))])
            for fout in _widths(self.out_parts)])
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Union[torch.Tensor, Sequence[torch.Tensor]]):
        if self.input_is_already_split:
            if len(input_) != self.in_splits:
                raise ValueError(f"TiledLinear: expected {self.in_splits} input parts, got {len(input_)}")
            inputs = list(input_)
        else:
            inputs = self._split_global_input(input_, _widths(self.in_parts))
        outputs = []
        for out_id, row in enumerate(self.linears):
            acc = None
            for in_id, (tile, x) in enumerate(zip(row, inputs)):
                acc = self._reduce_local_output(in_id=in_id, out_id=out_id, current_out=acc, new_out=tile(x))
            outputs.append(acc)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input_: torch.Tensor, split_sizes: List[int]) -> List[Any]:
        """The input cut along its last dimension into the input parts' widths."""
        return list(torch.split(input_, split_sizes, dim=-1))

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """One output part's running sum over the input parts."""
        return new_out if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: List[Any]) -> Any:
        """The output parts joined along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Linear) -> None:
        """Copies a whole Linear's weight (and bias) into the tiles; under ZeRO-3 both sides are gathered
        and rank 0's values are kept (so it works on partitioned modules, from any rank's source)."""
        if tuple(getattr(other.weight, "ds_shape", other.weight.shape)) != (self.out_features, self.in_features):
            raise TilingError(f"TiledLinear.copy_params_from: weight of shape {tuple(other.weight.shape)}, expected "
                              f"({self.out_features}, {self.in_features})")
        if self.use_bias != (other.bias is not None):
            raise TilingError(f"TiledLinear.copy_params_from: the tiles {'have' if self.use_bias else 'have no'} bias, "
                              f"the source Linear {'has none' if self.use_bias else 'has one'}")
        src = [other.weight] + ([other.bias] if other.bias is not None else [])
        with GatheredParameters(src):
            for r0, r1, row in zip(self.out_parts[:-1], self.out_parts[1:], self.linears):
                for c0, c1, tile in zip(self.in_parts[:-1], self.in_parts[1:], row):
                    dst = [tile.weight] + ([tile.bias] if tile.bias is not None else [])
                    with GatheredParameters(dst, modifier_rank=0):
                        tile.weight.copy_(other.weight[r0:r1, c0:c1])
                        if tile.bias is not None:
                            tile.bias.copy_(other.bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """TiledLinear over tiles that return ``(output, bias)`` (Megatron-style linears that leave adding the
    bias to the caller): outputs are summed over the input parts, the bias is not; the result is
    ``(output, bias)`` with the output parts' biases joined (None when no tile returns one)."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2):
            raise TypeError(f"TiledLinearReturnBias: a tile returned {type(new_out).__name__}; expected a tuple "
                            "(output, bias) (use TiledLinear for tiles that return a tensor)")
        tensor, bias = new_out
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        return (super()._reduce_local_output(in_id, out_id, old_tensor, tensor),
                bias if bias is not None else old_bias)

    def _combine_output_splits(self, outputs: List[Any]) -> Any:
        biases = [b for _, b in outputs if b is not None]
        return (super()._combine_output_splits([t for t, _ in outputs]),
                super()._combine_output_splits(biases) if biases else None)
