"""TiledLinear: equal to the Linear it tiles (split-K summation order aside), fetched one tile at a time."""
import pytest
import torch

from helpers.harness import run_ranks


@pytest.mark.parametrize("in_splits,out_splits", [(1, 1), (3, 2), (10, 1), (1, 7), (4, 3)])
def test_tiles_compute_the_whole_linear(in_splits, out_splits):
    from zero_ext.zero import TiledLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(10, 7)
    tiled = TiledLinear(10, 7, in_splits=in_splits, out_splits=out_splits, init_linear=lin)
    x = torch.randn(5, 10)
    assert torch.allclose(tiled(x), lin(x), rtol=1e-6, atol=1e-6)
    split = TiledLinear(10, 7, in_splits=in_splits, out_splits=out_splits, init_linear=lin,
                        input_is_already_split=True, combine_out_splits=False)
    widths = [b - a for a, b in zip(split.in_parts[:-1], split.in_parts[1:])]
    outs = split(list(torch.split(x, widths, dim=-1)))
    assert len(outs) == out_splits and torch.allclose(torch.cat(outs, -1), lin(x), rtol=1e-6, atol=1e-6)
    n_bias = sum(t.bias is not None for row in tiled.linears for t in row)
    assert n_bias == out_splits  # the bias is added once per output part


def test_bad_splits_and_shapes_are_named():
    from zero_ext.zero import TiledLinear

    with pytest.raises(ValueError, match="cannot cut 4 input features into 5 parts"):
        TiledLinear(4, 3, in_splits=5)
    with pytest.raises(RuntimeError, match="cannot cut 3 output features into 0 parts"):  # DeepSpeed's type too
        TiledLinear(4, 3, out_splits=0)
    with pytest.raises(ValueError, match="the tiles have bias, the source Linear has none"):
        TiledLinear(4, 3, init_linear=torch.nn.Linear(4, 3, bias=False))
    with pytest.raises(ValueError, match=r"weight of shape \(3, 5\), expected \(3, 4\)"):
        TiledLinear(4, 3, init_linear=torch.nn.Linear(5, 3))


def test_parts_are_boundaries_with_the_remainder_on_the_first_parts():
    from zero_ext.zero import TiledLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(11, 7)
    tiled = TiledLinear(11, 7, in_splits=3, out_splits=2, init_linear=lin)
    assert tiled.in_parts == [0, 4, 8, 11] and tiled.out_parts == [0, 4, 7]  # 11 = 4+4+3, 7 = 4+3
    for r, row in enumerate(tiled.linears):
        for c, tile in enumerate(row):
            rows = slice(tiled.out_parts[r], tiled.out_parts[r + 1])
            cols = slice(tiled.in_parts[c], tiled.in_parts[c + 1])
            assert torch.equal(tile.weight, lin.weight[rows, cols])
            assert (tile.bias is not None) == (c == 2)


class _LinearReturningBias(torch.nn.Linear):
    """A Megatron-style linear: the bias is returned, not added."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), self.bias


def test_return_bias_tiles_sum_outputs_and_join_biases():
    from zero_ext.zero import TiledLinearReturnBias

    torch.manual_seed(0)
    lin = torch.nn.Linear(10, 6)
    tiled = TiledLinearReturnBias(10, 6, in_splits=3, out_splits=2, linear_cls=_LinearReturningBias, init_linear=lin)
    x = torch.randn(4, 10)
    out, bias = tiled(x)
    assert torch.allclose(out, x @ lin.weight.t(), rtol=1e-6, atol=1e-6)
    assert torch.equal(bias, lin.bias)
    nobias = TiledLinearReturnBias(10, 6, bias=False, in_splits=2, linear_cls=_LinearReturningBias)
    assert nobias(x)[1] is None
    with pytest.raises(TypeError, match="expected a tuple"):
        TiledLinearReturnBias(10, 6, in_splits=2)(x)


def _tiled_model():
    from zero_ext.zero import TiledLinear

    torch.manual_seed(0)
    return torch.nn.Sequential(TiledLinear(8, 12, in_splits=2, out_splits=3), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _train_tiled_at_stage3():
    import zero_ext

    # torch_adam: the reference's torch.optim.AdamW, so one rank agrees bit for bit
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    # one tile's weight and bias (16 + 4 elements): no prefetching or
                                    # keeping for reuse beyond that, the memory bound tiles are for
                                    "stage3_max_live_parameters": 20}}
    model = _tiled_model()
    engine = zero_ext.initialize(model=model, config=config)[0]
    tiles = [t for row in model[0].linears for t in row]
    live = []

    def count(module, args):
        live.append(sum(p.ds_status.name == "AVAILABLE" for t in tiles for p in t.parameters()))

    for t in tiles:
        t.register_forward_pre_hook(count)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        x, y = torch.randn(2 * world, 8, generator=gen), torch.randn(2 * world, 3, generator=gen)
        loss = (engine(x[2 * rank:2 * rank + 2]) - y[2 * rank:2 * rank + 2]).pow(2).mean()
        engine.backward(loss)
        engine.step()
    with zero_ext.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return params, max(live)


@pytest.mark.parametrize("world", [1, 2])
def test_tiled_linear_inside_a_stage_3_model_matches_pytorch(world):
    params, most_live = run_ranks(world, _train_tiled_at_stage3)[0]
    ref = _tiled_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)  # DeepSpeed's default
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        x, y = torch.randn(2 * world, 8, generator=gen), torch.randn(2 * world, 3, generator=gen)
        for r in range(world):
            loss = (ref(x[2 * r:2 * r + 2]) - y[2 * r:2 * r + 2]).pow(2).mean()
            (loss / world if world > 1 else loss).backward()
        opt.step()
        opt.zero_grad()
    for n, p in ref.named_parameters():
        if world == 1:
            assert torch.equal(params[n], p.detach()), n
        else:
            assert ((params[n] - p.detach()).abs() <= 1e-5 * (p.detach().abs() + 1e-2)).all(), n
    assert most_live <= 2  # one tile (weight, maybe bias) gathered at a time


def _init_under_zero(seed_per_rank):
    import zero_ext
    from zero_ext.zero import TiledLinear

    torch.manual_seed(torch.distributed.get_rank() if seed_per_rank else 0)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    lin = torch.nn.Linear(9, 5)
    with zero_ext.zero.Init(config_dict_or_path=config):
        tiled = TiledLinear(9, 5, in_splits=2, out_splits=2, init_linear=lin)
    x = torch.ones(2, 9)
    with zero_ext.zero.GatheredParameters(list(tiled.parameters())):
        out = tiled(x).detach()
    return out, lin(x).detach()


def test_init_linear_under_zero_init_takes_rank_0s_weights():
    results = run_ranks(2, _init_under_zero, True)
    ref = results[0][1]  # rank 0's Linear
    for out, _ in results:
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
