"""initialize(mpu=...): a Megatron-style model-parallel unit. Four real ranks in a 2 x 2 grid -- data-parallel
groups {0, 2} and {1, 3}, model-parallel groups {0, 1} and {2, 3} -- train a model whose weight is split
over the model-parallel ranks (row halves, marked ``model_parallel``) and whose scale vector is replicated
on them; gradients are averaged over the data-parallel group only, and the clipped norm spans both groups,
counting the replicated vector once. The result must equal one plain PyTorch model trained on the whole
batch with torch's clip_grad_norm_."""
import pytest
import torch

from helpers.harness import run_ranks

IN, OUT, MICRO, LR, CLIP = 6, 4, 2, 1e-2, 0.05


class Grid:
    """The mpu: data-parallel rank = global rank // 2, model-parallel rank = global rank % 2."""

    def __init__(self):
        import torch.distributed as dist

        rank = dist.get_rank()
        # every rank creates every group, in the same order (torch.distributed's rule)
        dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        self.dp, self.mp = dp[rank % 2], mp[rank // 2]
        self.dp_rank, self.mp_rank = rank // 2, rank % 2

    def get_data_parallel_group(self):
        return self.dp

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return 2

    def get_model_parallel_group(self):
        return self.mp

    def get_model_parallel_rank(self):
        return self.mp_rank

    def get_model_parallel_world_size(self):
        return 2


class _SumOverModelParallel(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the model-parallel group (Megatron's copy to the
    tensor-parallel region): the replicated input's gradient is the whole model's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class HalfModel(torch.nn.Module):
    """This model-parallel rank's half: y_half = (x * scale) @ W_half^T."""

    def __init__(self, full_weight, full_scale, mp_rank, group):
        super().__init__()
        rows = full_weight.shape[0] // 2
        self.weight = torch.nn.Parameter(full_weight[mp_rank * rows:(mp_rank + 1) * rows].clone())
        self.weight.model_parallel = True
        self.scale = torch.nn.Parameter(full_scale.clone())  # replicated on both model-parallel ranks
        self.group = group

    def forward(self, x):
        return _SumOverModelParallel.apply(x * self.scale, self.group) @ self.weight.t()


def _start():
    torch.manual_seed(0)
    return torch.randn(OUT, IN), 1.0 + 0.1 * torch.randn(IN)


def _batches(steps):
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(2 * MICRO, IN, generator=gen), torch.randn(2 * MICRO, OUT, generator=gen))
            for _ in range(steps)]


def _train_on_the_grid(stage, steps):
    import zero_ext

    grid = Grid()
    weight, scale = _start()
    model = HalfModel(weight, scale, grid.mp_rank, grid.mp)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine = zero_ext.initialize(model=model, config=config, mpu=grid)[0]
    rows = slice(grid.mp_rank * OUT // 2, (grid.mp_rank + 1) * OUT // 2)
    norms = []
    for x, y in _batches(steps):
        mine = slice(grid.dp_rank * MICRO, (grid.dp_rank + 1) * MICRO)
        # the loss of this half of the outputs; the whole loss is the sum over the halves
        loss = (engine(x[mine]) - y[mine, rows]).pow(2).sum() / (MICRO * OUT)
        engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
    with zero_ext.zero.GatheredParameters(list(model.parameters())):
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
    sizes = (engine.world_size, engine.train_batch_size())
    try:
        engine.save_checkpoint("/nonexistent-unused")
        refused = ""
    except NotImplementedError as exc:
        refused = str(exc)
    engine.destroy()
    return grid.mp_rank, out, norms, sizes, refused


def _reference(steps):
    weight, scale = _start()
    w, s = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(scale.clone())
    opt = torch.optim.AdamW([w, s], lr=LR, weight_decay=0.0, foreach=False)
    norms = []
    for x, y in _batches(steps):
        total = 0.0
        for dp in range(2):  # the data-parallel average of the per-rank losses
            mine = slice(dp * MICRO, (dp + 1) * MICRO)
            total = total + ((x[mine] * s) @ w.t() - y[mine]).pow(2).sum() / (MICRO * OUT)
        (total / 2).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([w, s], CLIP)))
        opt.step()
        opt.zero_grad()
    return w.detach(), s.detach(), norms


@pytest.mark.parametrize("stage", [1, 3])
def test_a_2x2_grid_trains_like_one_model(stage):
    steps = 3
    w, s, ref_norms = _reference(steps)
    for mp_rank, out, norms, sizes, refused in run_ranks(4, _train_on_the_grid, stage, steps):
        half = w[mp_rank * OUT // 2:(mp_rank + 1) * OUT // 2]
        assert ((out["weight"] - half).abs() <= 1e-5 * (half.abs() + LR)).all()
        assert ((out["scale"] - s).abs() <= 1e-5 * (s.abs() + LR)).all()
        assert norms == pytest.approx(ref_norms, rel=1e-5)  # (clipping was active: CLIP is below every norm)
        assert min(ref_norms) > CLIP
        assert sizes == (2, 2 * MICRO)  # the data-parallel size drives the batch
        assert "model-parallel" in refused


def test_an_mpu_without_the_group_accessors_is_named():
    from zero_ext.comm.mpu import parallel_groups

    class OnlyData:
        def get_data_parallel_group(self):
            return None

    with pytest.raises(TypeError, match="no get_data_parallel_rank"):
        parallel_groups(object.__new__(OnlyData))
