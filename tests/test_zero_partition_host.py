"""A model not built under zero.Init is partitioned parameter by parameter from where it is (host
memory): only each rank's piece moves to the compute device, never a whole parameter (so the whole model
never has to fit there). Here the compute device is `meta` (no GPU on the development machine): every
copy to it is logged by a dispatch mode, and none may be larger than a piece. A CPU parameter cannot
take meta storage (a CUDA one can: both are dense), so the ZeroParam made from each piece is replaced
by a record of it; the cutting, the scatter from rank 0 and the move are the real ones."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.harness import run_ranks


class _CopiesTo(TorchDispatchMode):
    def __init__(self, device):
        super().__init__()
        self.device, self.sizes = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and torch.device(kwargs.get("device", "cpu")) == self.device:
            self.sizes.append(args[0].numel())
        return out


def _partition_on_host():
    from zero_ext.zero import convert

    class Made:  # what would become the ZeroParam (the worker process is pooled: restored below)
        def __init__(self, p, ds_id, group, rank, world, piece, compute):
            self.param, self.piece, self.compute = p, piece, compute

        def rename(self, name):
            pass
    real, convert.ZeroParam = convert.ZeroParam, Made
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 10))
        numels = [p.numel() for p in model.parameters()]
        log = _CopiesTo(torch.device("meta"))
        with log:
            made = convert.partition_module(model, device=torch.device("meta"))
    finally:
        convert.ZeroParam = real
    return (numels, [m.piece.numel() for m in made], log.sizes,
            [f"{m.piece.device}/{m.compute}" for m in made])


def test_a_model_in_host_memory_moves_only_pieces_to_the_compute_device():
    for numels, shards, copied, devices in run_ranks(2, _partition_on_host):
        assert shards == [-(-n // 2) for n in numels]
        assert sorted(copied) == sorted(shards), "each piece moved once, nothing larger"
        assert devices == ["meta/meta"] * len(numels)
