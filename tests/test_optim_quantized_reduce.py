"""optim/quantized_reduce.py's per-piece path (the one CUDA tensors take, where the C record batches do not
run), run here on CPU tensors: in one level and in two (nodes of 2 ranks), it must give the bits of the
batched path every CPU run takes (reduce_scatter_quantized), which the engine tests check against the
ZeRO++ reference, for int4 pieces, raw 1-D pieces and a piece shorter than its shard."""
import pytest
import torch

from helpers.harness import run_ranks

SHAPES = [(70, 9), (33,), (5, 130), (7,)]  # numels 630, 33, 650, 7: quantized, raw, quantized, raw


def _both_paths(node_size, dtype_name):
    from zero_ext import comm
    from zero_ext.optim.quantized_reduce import Hierarchy, reduce_scatter_per_piece, reduce_scatter_quantized

    rank, world = comm.get_rank(), comm.get_world_size()
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(11 + rank)
    grads = [torch.randn(*shape, generator=gen).to(dtype).reshape(-1) for shape in SHAPES]
    shards = [-(-g.numel() // world) for g in grads]
    quantized = [len(shape) > 1 for shape in SHAPES]
    hierarchy = Hierarchy.build(node_size, world, rank, comm.new_group) if node_size else None
    batched = reduce_scatter_quantized(grads, shards, quantized, None, rank, world, hierarchy).wait()
    block = sum(shards)
    buf = torch.zeros(world * block, dtype=dtype)  # the bucket as the shard groups lay it out: rank-major
    pieces, at = [], 0
    for g, shard, q in zip(grads, shards, quantized):
        for d in range(world):
            part = g[d * shard:(d + 1) * shard]
            buf[d * block + at:d * block + at + part.numel()].copy_(part)
        pieces.append((at, shard, q))
        at += shard
    per_piece = reduce_scatter_per_piece(buf, block, pieces, None, rank, world, hierarchy)
    return batched, per_piece, hierarchy is not None


@pytest.mark.parametrize("world,node_size,dtype", [(2, 0, "float32"), (3, 0, "bfloat16"), (4, 2, "float32"),
                                                   (4, 2, "bfloat16")])
def test_the_per_piece_path_gives_the_batched_paths_bits(world, node_size, dtype):
    for rank, (batched, per_piece, two_levels) in enumerate(run_ranks(world, _both_paths, node_size, dtype)):
        assert two_levels == bool(node_size)
        assert batched.dtype == per_piece.dtype == torch.float32 and batched.shape == per_piece.shape
        assert torch.equal(batched, per_piece), (rank, (batched - per_piece).abs().max())
