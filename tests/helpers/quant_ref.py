"""Block quantization written with torch operations, independent of zero_ext's kernels: the reference
for the C / CUDA kernels (test_ops_quantize.py) and for ZeRO++'s quantized gathers in training."""
import torch

LEVEL = {"int8": 127, "int4": 7}


def reference(x, format, block):
    """(integers as int32, scales) of x's elements in fp32: s = amax / L, q = round(x * (L / amax))
    per block; a block with a NaN or an infinity has s = NaN and q = 0."""
    L = LEVEL[format]
    xf = x.float().flatten()
    q = torch.zeros(xf.numel(), dtype=torch.int32)
    scales = []
    for b in range(0, xf.numel(), block):
        blk = xf[b:b + block]
        if not torch.isfinite(blk).all():
            scales.append(float("nan"))
            continue
        amax = blk.abs().max()
        scales.append((amax / L).item())
        if amax > 0:
            inv = torch.tensor(L, dtype=torch.float32) / amax
            q[b:b + block] = torch.round(blk * inv).clamp(-L, L).to(torch.int32)
    return q, torch.tensor(scales, dtype=torch.float32)


def fake_quantize(x, format, block):
    """x's values after quantizing and dequantizing (same dtype and shape)."""
    q, scales = reference(x, format, block)
    return (q.float() * scales.repeat_interleave(block)[: q.numel()]).to(x.dtype).view(x.shape)


def gathered_weight(w, world, format="int8", block=2048):
    """What a ZeRO-3 quantized all-gather gives every rank for parameter value ``w``: each rank's piece
    (ceil(numel / world) elements, the last padded with zeros) quantized on its own, then dequantized."""
    flat = w.detach().flatten()
    shard = -(-flat.numel() // world)
    padded = torch.zeros(world * shard, dtype=w.dtype)
    padded[: flat.numel()] = flat
    pieces = [fake_quantize(padded[r * shard:(r + 1) * shard], format, block) for r in range(world)]
    return torch.cat(pieces)[: flat.numel()].view(w.shape)


def reduced_gradient(grads, world, quantized, format="int4", block=512):
    """What a quantized reduce-scatter (ZeRO++ qgZ) leaves in the pieces of one parameter, as one flat fp32
    tensor of its numel: for every rank in rank order, each of its pieces of the full gradient ``grads[r]``
    quantized on its own (``quantized``; else exact) and added in fp32. Not yet divided by the world."""
    numel = grads[0].numel()
    shard = -(-numel // world)
    total = torch.zeros(world * shard)
    for g in grads:
        padded = torch.zeros(world * shard, dtype=g.dtype)
        padded[:numel] = g.flatten()
        for d in range(world):
            piece = padded[d * shard:(d + 1) * shard]
            if quantized:
                q, scales = reference(piece, format, block)
                piece = q.float() * scales.repeat_interleave(block)[: q.numel()]
            total[d * shard:(d + 1) * shard] += piece
    return total[:numel]
