"""ZeRO++'s ``zero_quantized_nontrainable_weights``: the pieces of frozen parameters kept as int8.

[Note: quantized frozen pieces]
A frozen parameter's piece (LoRA's base weights, an embedding left as it is) is never stepped, so it can
live in the qwZ format (int8, an fp32 scale per 2048 elements, quantized from the piece's start): a
quarter of its fp32 bytes, half of its bf16 ones. This store is the piece's home, as NVMePieces is for
pieces on NVMe (``ZeroParam.place_piece``): the parameter's ``ds_tensor`` is empty, a gather reads the
dequantized piece (``read``), and a modified full value (GatheredParameters with a modifier, a
checkpoint load) is quantized again when its use ends (``resident``). So every rank computes with the
dequantized weights, from the first forward on, and the quantization happens once, when the engine is
built. ``memory_breakdown()`` counts the integers and scales under ``params``.
"""
import contextlib
from typing import Dict, List

import torch

from ..ops.quantize import dequantize, quantize
from .quantized_gather import WEIGHT_BLOCK, WEIGHT_FORMAT


class QuantizedPieces:
    """The int8 homes of frozen parameters' pieces."""

    def __init__(self):
        self._pieces: Dict[int, object] = {}  # id(zp) -> QuantizedTensor
        self._owners: Dict[int, object] = {}
        self._resident: Dict[int, int] = {}  # id(zp) -> nesting depth of resident()

    def add(self, zp) -> None:
        """Quantize zp's piece and keep it here; its ds_tensor becomes empty."""
        self._pieces[id(zp)] = quantize(zp.shard.detach().contiguous(), WEIGHT_FORMAT, WEIGHT_BLOCK)
        self._owners[id(zp)] = zp
        zp.shard.data = torch.empty(0, dtype=zp.dtype, device=zp.shard.device)
        zp.place_piece(self)

    def holds(self, zp) -> bool:
        return id(zp) in self._pieces

    def read(self, zp) -> torch.Tensor:
        """zp's piece, dequantized (a fresh tensor), for a gather."""
        return dequantize(self._pieces[id(zp)]).reshape(-1)

    @contextlib.contextmanager
    def resident(self, zp, modified: bool = True):
        """zp's piece as its ds_tensor for the block (dequantized), quantized again after it if modified."""
        key = id(zp)
        depth = self._resident.get(key, 0)
        self._resident[key] = depth + 1
        if depth == 0:
            zp.shard.data = self.read(zp)
        try:
            yield
        finally:
            self._resident[key] = depth
            if depth == 0:
                if modified:
                    qt = self._pieces[key]
                    quantize(zp.shard.detach(), WEIGHT_FORMAT, WEIGHT_BLOCK, out=qt)
                zp.shard.data = torch.empty(0, dtype=zp.dtype, device=zp.shard.device)

    def forget(self, zp) -> None:
        """The piece goes back to being zp's own tensor (dequantized)."""
        zp.shard.data = self.read(zp)
        del self._pieces[id(zp)], self._owners[id(zp)]
        self._resident.pop(id(zp), None)
        zp.place_piece(None)

    def release_all(self) -> None:
        for zp in list(self._owners.values()):
            self.forget(zp)

    def tensors(self) -> List[torch.Tensor]:
        """The integers and scales held (memory accounting)."""
        return [t for qt in self._pieces.values() for t in (qt.data, qt.scales)]
