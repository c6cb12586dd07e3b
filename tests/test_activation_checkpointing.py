"""deepspeed.checkpointing (zero_ext.activation_checkpointing): parity with torch.utils.checkpoint for
every setting, what is kept between forward and backward (partitions over a model-parallel group of 2
gloo ranks, host copies, contiguous buffers) and its bytes, the config section honoured by initialize,
memory_breakdown's activations, the profile log and the settings' errors."""
import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from helpers.harness import run_ranks

D, BATCH, LAYERS = 8, 6, 3


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(D, 3 * D), nn.Linear(3 * D, D), nn.Dropout(0.25)

    def forward(self, x, scale=None):
        h = self.fc2(self.drop(torch.relu(self.fc1(x))))  # dropout: the recomputation must replay the RNG
        return x + (h if scale is None else h * scale)


class Net(nn.Module):
    def __init__(self, ckpt=None):
        super().__init__()
        self.ckpt = ckpt
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.head = nn.Linear(D, 1)

    def forward(self, x, scale=None):
        for layer in self.layers:
            if self.ckpt is None:
                x = layer(x, scale=scale)
            else:
                x = self.ckpt(layer, x, scale=scale)
        return self.head(x).pow(2).mean()


def _torch_ckpt(fn, *args, **kwargs):
    return torch_checkpoint(fn, *args, *kwargs.values(), use_reentrant=True)  # (torch's takes no keywords)


class WorldMpu:
    """A model-parallel unit whose group is every rank (inputs replicated, as under tensor parallelism)."""

    def get_model_parallel_rank(self):
        return torch.distributed.get_rank()

    def get_model_parallel_world_size(self):
        return torch.distributed.get_world_size()

    def get_model_parallel_group(self):
        return torch.distributed.group.WORLD


def _run(settings, mpu=False):
    """Losses and gradients of two steps with deepspeed.checkpointing under ``settings`` against torch's
    checkpoint, plus the bytes kept after a forward and after its backward."""
    import zero_ext
    ds = zero_ext.checkpointing
    ds.reset_settings()
    ds.configure(WorldMpu() if mpu else None, **settings)
    torch.manual_seed(0)
    ref, net = Net(_torch_ckpt), Net(ds.checkpoint)
    net.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(1)  # the same data on every rank (replicated activations)
    losses, kept = [], []
    for _ in range(2):
        x = torch.randn(BATCH, D, generator=gen, requires_grad=True)
        scale = torch.full((D,), 0.5)
        x2 = x.detach().clone().requires_grad_(True)
        torch.manual_seed(7)
        a = ref(x, scale=scale)
        torch.manual_seed(7)
        b = net(x2, scale=scale)
        kept.append(ds.held_bytes())
        a.backward()
        b.backward()
        kept.append(ds.held_bytes())
        losses.append((a.item(), b.item()))
        assert torch.equal(x.grad, x2.grad)
    same = all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), net.parameters()))
    ds.reset_settings()
    return losses, same, kept


ONE_INPUT, SCALE = BATCH * D * 4, D * 4  # bytes of one layer's inputs x and scale (fp32)
SETTINGS = {
    "default": ({}, 0),
    # on a CPU-only run host memory is the device's: the inputs themselves are kept (scale: one tensor)
    "cpu": ({"checkpoint_in_cpu": True}, LAYERS * ONE_INPUT + SCALE),
    "partition-no-mpu": ({"partition_activations": True}, 0),  # no model-parallel group: kept whole
    "contiguous": ({"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": LAYERS},
                   LAYERS * (ONE_INPUT + SCALE)),  # copies in the buffers, scale's too
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_one_process_matches_torch_checkpoint(name):
    settings, kept_after_forward = SETTINGS[name]
    [(losses, same, kept)] = run_ranks(1, _run, settings)
    assert all(a == b for a, b in losses) and same
    assert kept == [kept_after_forward, 0] * 2


@pytest.mark.parametrize("settings", [
    {"partition_activations": True},
    {"partition_activations": True, "checkpoint_in_cpu": True, "contiguous_checkpointing": True,
     "num_checkpoints": LAYERS},
], ids=["partition", "partition-cpu-contiguous"])
def test_partitioned_over_two_ranks_keeps_half_and_gathers_in_backward(settings):
    for losses, same, kept in run_ranks(2, _run, settings, True):
        assert all(a == b for a, b in losses) and same  # the all-gather gives back the exact inputs
        assert kept == [LAYERS * (ONE_INPUT + SCALE) // 2, 0] * 2  # each rank keeps its half of every input


def _saved_bytes_plain_vs_kept():
    """Bytes autograd saves for a plain forward (every activation) vs what a partitioned checkpointed
    forward keeps (1/2 of each layer's input)."""
    import zero_ext
    ds = zero_ext.checkpointing
    ds.reset_settings()
    ds.configure(WorldMpu(), partition_activations=True)
    torch.manual_seed(0)
    plain, net = Net(), Net(ds.checkpoint)
    x = torch.randn(BATCH, D, requires_grad=True)  # (a reentrant checkpoint needs an input that requires grad)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plain(x)
    params = sum(p.numel() * 4 for p in plain.parameters())
    activations = sum(storages.values()) - params  # weights are saved too; not activations
    net(x).backward()  # (nothing kept after)
    loss = net(x)
    kept = ds.held_bytes()
    loss.backward()
    ds.reset_settings()
    return activations, kept


def test_bytes_kept_are_a_fraction_of_the_plain_activations():
    for activations, kept in run_ranks(2, _saved_bytes_plain_vs_kept):
        assert kept == LAYERS * ONE_INPUT // 2
        assert activations > 8 * kept  # fc1/relu/dropout/fc2 activations of every layer, whole


def _engine_section(stage):
    """initialize with an activation_checkpointing section (cpu_checkpointing): the kept inputs show in
    memory_breakdown()['activations'] as host memory until backward, and training equals the plain model's."""
    import zero_ext
    ds = zero_ext.checkpointing
    ds.reset_settings()
    torch.manual_seed(0)
    ref, model = Net(), Net(ds.checkpoint)
    model.load_state_dict(ref.state_dict())
    for layer in (*ref.layers, *model.layers):
        layer.drop.p = 0.0
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage},
              "activation_checkpointing": {"cpu_checkpointing": True, "profile": True}}
    engine, *_ = zero_ext.initialize(model=model, config=config)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zero_ext.checkpointing").addHandler(handler)
    logging.getLogger("zero_ext.checkpointing").setLevel(logging.INFO)
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(2):
        # the same on both ranks (the average is the plain gradient); requiring grad, as reentrant checkpoints need
        x = torch.randn(BATCH, D, generator=gen).requires_grad_(True)
        loss = engine(x)
        during = engine.memory_breakdown()["activations"]
        engine.backward(loss)
        after = engine.memory_breakdown()["activations"]
        engine.step()
        ref_loss = ref(x)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), ref_loss.item(), during, after))
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    mine = {n: zero_ext.utils.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    drift = max((full[n] - mine[n]).abs().max().item() for n in full)
    phases = sorted({r.getMessage().split("| ")[1].split(":")[0] for r in records})
    logging.getLogger("zero_ext.checkpointing").removeHandler(handler)
    engine.destroy()
    configured = ds.is_configured()
    ds.reset_settings()
    return out, drift, phases, configured


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_config_section_is_honoured(stage):
    results = run_ranks(2, _engine_section, stage)
    for rank_out, drift, phases, configured in results:
        for loss, ref_loss, during, after in rank_out:
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss) + 1e-7
            assert during["host"] == LAYERS * ONE_INPUT and during["accelerator"] == 0
            assert after == {"accelerator": 0, "host": 0, "nvme": 0}
        assert drift <= 1e-5
        assert configured is False  # a section applied by initialize is not a user's configure()
    assert [r[2] for r in results] == [["backward", "forward"], []]  # profile: rank 0 logs both phases


def test_configure_errors_and_argument_precedence(tmp_path):
    import json

    import zero_ext
    ds = zero_ext.checkpointing
    ds.reset_settings()
    try:
        with pytest.raises(ValueError, match="needs partition_activations"):
            ds.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
        with pytest.raises(AssertionError, match="needs number_checkpoints"):  # (what DeepSpeed raises, too)
            ds.configure(None, partition_activations=True, contiguous_checkpointing=True)
        with pytest.raises(TypeError, match="get_model_parallel_rank"):
            ds.configure(object())
        assert not ds.is_configured()
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"activation_checkpointing": {"partition_activations": True,
                                                                 "number_checkpoints": 4, "profile": True}}))
        ds.configure(None, deepspeed_config=str(path), profile=False)
        s = ds.current()
        assert ds.is_configured() and s.partition_activations and s.number_checkpoints == 4 and not s.profile
        assert ds.PARTITION_ACTIVATIONS and ds.num_layers == 4 and not ds.CPU_CHECKPOINT  # DeepSpeed's globals
        with pytest.raises(ValueError, match="partition_activation"):  # a misspelt key is named
            ds.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activation": True}})
        ds.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1)
        layer = Layer()
        x = torch.randn(2, D, requires_grad=True)
        ds.checkpoint(layer, x)
        with pytest.raises(ValueError, match="more than number_checkpoints=1"):
            ds.checkpoint(layer, x)
        ds.reset()  # after an evaluation-like forward: the buffers start again
        ds.checkpoint(layer, x).sum().backward()
        with torch.no_grad():  # nothing is kept without grad
            ds.checkpoint(layer, x)
        assert ds.held_bytes() == 0
    finally:
        ds.reset_settings()
