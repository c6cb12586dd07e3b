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


def reduced_gradient(grads, world, quantized, format="int4", block=512, node=1):
    """What a quantized reduce-scatter (ZeRO++ qgZ) leaves in the pieces of one parameter, as one flat fp32
    tensor of its numel: for every rank in rank order, each of its pieces of the full gradient ``grads[r]``
    quantized on its own (``quantized``; else exact) and added in fp32. Not yet divided by the world.
    ``node`` > 1 (a divisor of world, below it): two levels, as DeepSpeed's all_to_all_quant_reduce: each
    node's ranks' pieces added in local order (fp32), that partial sum quantized again (fp32 input), and
    the nodes' partials added in node order."""
    numel = grads[0].numel()
    shard = -(-numel // world)

    def wire(piece):
        if not quantized:
            return piece.float()
        q, scales = reference(piece, format, block)
        return q.float() * scales.repeat_interleave(block)[: q.numel()]

    def padded(g):
        out = torch.zeros(world * shard, dtype=g.dtype)
        out[:numel] = g.flatten()
        return out

    levels = [list(range(world))] if node <= 1 or node >= world else \
        [list(range(start, start + node)) for start in range(0, world, node)]
    total = torch.zeros(world * shard)
    for d in range(world):
        partials = []
        for ranks in levels:
            acc = torch.zeros(shard)
            for r in ranks:
                acc += wire(padded(grads[r])[d * shard:(d + 1) * shard])
            partials.append(acc)
        if len(partials) == 1:
            total[d * shard:(d + 1) * shard] = partials[0]
        else:
            acc = torch.zeros(shard)
            for p in partials:
                acc += wire(p)
            total[d * shard:(d + 1) * shard] = acc
    return total[:numel]
