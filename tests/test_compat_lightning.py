"""Lightning's DeepSpeedStrategy (lightning.pytorch.strategies) on zero_ext, through the
`deepspeed` compatibility package, on 2 gloo CPU ranks: ZeRO stage 2, stage 3 and stage 3 with
parameter and optimizer offload (there with a layer under deepspeed.checkpointing.checkpoint, the
strategy's cpu_checkpointing and partition_activations on) train as Lightning's DDP does; a run saved
mid-way and resumed goes on as DDP resumed from its own checkpoint; Lightning's
convert_zero_checkpoint_to_fp32_state_dict recovers the final weights.

Lightning refuses DeepSpeed on anything but CUDA (``setup_environment``, ``setup_distributed``); the
strategy here is Lightning's with only those checks skipped. The ranks are started by the test harness
with torchrun's variables, and Lightning is told so (TorchElasticEnvironment): it creates no processes
of its own.

Parity: the per-step training losses and the final weights equal DDP's within a relative 1e-6 (fp32;
Adam steps a flat partition instead of each tensor, and the gradients are averaged by another
collective: same formulas, rounding may differ in the last bit).
"""
import importlib.util
import os
import sys

import pytest
import torch

from helpers.compat_site import install_compat
from helpers.harness import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="needs lightning (scripts/setup.sh installs it)")

TIMEOUT = 300  # the first case imports lightning on each rank (seconds on a loaded machine)
STEPS, RTOL = 4, 1e-6


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_compat(str(tmp_path_factory.mktemp("compat")))


def _lightning(site_dir):
    """Imports lightning on a rank, with this test's compat package as `deepspeed`."""
    if site_dir not in sys.path:
        sys.path.insert(0, site_dir)
    import deepspeed
    assert "+zeroext" in deepspeed.__version__, deepspeed.__file__
    import logging

    import lightning.pytorch as pl
    for name in ("lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return pl


def _module_class(pl):
    import torch
    from torch import nn

    class Regression(pl.LightningModule):
        """Two linear layers on fixed random data; logs its loss every step."""

        def __init__(self, cpu_adam=False, checkpoint=None):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
            self.cpu_adam, self.checkpoint = cpu_adam, checkpoint
            self.losses = []

        def training_step(self, batch, _):
            x, y = batch
            h = self.net[0](x)
            out = self.checkpoint(self.net[1:], h) if self.checkpoint else self.net[1:](h)
            loss = (out - y).pow(2).mean()
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            if self.cpu_adam:  # what Lightning users write for optimizer offload
                from deepspeed.ops.adam import DeepSpeedCPUAdam
                return DeepSpeedCPUAdam(self.parameters(), lr=1e-2, adamw_mode=False)
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)

    return Regression


def _strategy(pl, kind):
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    env = TorchElasticEnvironment()
    if kind == "ddp":
        return DDPStrategy(cluster_environment=env, process_group_backend="gloo")

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """Lightning's DeepSpeedStrategy without its CUDA-only checks (the accelerator's type, and CUDA
        device indices equal to the local ranks)."""

        def setup_environment(self):
            DDPStrategy.setup_environment(self)

        def setup_distributed(self):
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

    offload = kind == "z3-offload"
    return CPUDeepSpeedStrategy(stage=3 if kind.startswith("z3") else 2, offload_optimizer=offload,
                                offload_parameters=offload, cluster_environment=env, process_group_backend="gloo",
                                logging_batch_size_per_gpu=4, cpu_checkpointing=offload,
                                partition_activations=offload)


def _fit(site_dir, kind, root, steps=STEPS, save_at=(), resume=None, convert=False):
    """Fits the regression for ``steps`` optimizer steps under ``kind`` (ddp, z2, z3, z3-offload); returns
    the losses of every step (this rank's), the final full weights, and the checkpoints saved after the
    steps ``save_at`` (Trainer.save_checkpoint: a DeepSpeed checkpoint folder); ``convert``: rank 0 also
    returns the last checkpoint as Lightning's convert_zero_checkpoint_to_fp32_state_dict writes it."""
    pl = _lightning(site_dir)
    import torch

    os.environ["TORCHELASTIC_RUN_ID"] = "zero_ext-test"  # torchrun-started ranks: Lightning spawns nothing
    Regression = _module_class(pl)
    checkpoint = None
    if kind == "z3-offload":  # the second layer checkpointed (recomputation is exact: DDP's numbers still)
        import deepspeed
        checkpoint = deepspeed.checkpointing.checkpoint
    model = Regression(cpu_adam=kind == "z3-offload", checkpoint=checkpoint)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=_strategy(pl, kind), max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0)
    saved = {}

    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer, *_):
            step = trainer.global_step
            if step in save_at and step not in saved:
                saved[step] = os.path.join(root, f"{kind}-step{step}.ckpt")
                trainer.save_checkpoint(saved[step])
    trainer.callbacks.append(SaveAt())
    trainer.fit(model, ckpt_path=resume)
    engine = trainer.strategy.model
    stage = engine.zero_optimization_stage() if kind != "ddp" else None
    if kind == "ddp":
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine.destroy()
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    converted = None
    if convert and trainer.global_rank == 0:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        out = os.path.join(root, "model.pt")
        convert_zero_checkpoint_to_fp32_state_dict(saved[max(saved)], out)
        converted = torch.load(out, weights_only=False)
    return [l.item() for l in model.losses], weights, saved, stage, converted


@pytest.fixture(scope="module")
def ddp(site, tmp_path_factory):
    return run_ranks(2, _fit, site, "ddp", str(tmp_path_factory.mktemp("ddp")), STEPS, (2,), init=False,
                     timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ddp_resumed(site, ddp, tmp_path_factory):
    """DDP resumed from its step-2 checkpoint (Lightning restarts a plain DataLoader's epoch on resume: the
    reference for a resumed run is a resumed DDP run, not the uninterrupted one)."""
    return run_ranks(2, _fit, site, "ddp", str(tmp_path_factory.mktemp("ddp-resumed")), STEPS, (), ddp[0][2][2],
                     init=False, timeout=TIMEOUT)


def _close(a, b):
    return abs(a - b) <= RTOL * abs(b) + 1e-7


def _same_run(run, ref):
    for (losses, weights, *_), (ref_losses, ref_weights, *_) in zip(run, ref):
        assert len(losses) == len(ref_losses)
        assert all(_close(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        assert sorted(weights) == sorted(ref_weights)
        for n in weights:
            diff = (weights[n] - ref_weights[n]).abs().max().item()
            assert diff <= RTOL * ref_weights[n].abs().max().item() + 1e-7, (n, diff)


@pytest.mark.parametrize("kind", ["z2", "z3", "z3-offload"])
def test_strategy_trains_as_ddp(site, ddp, kind, tmp_path):
    run = run_ranks(2, _fit, site, kind, str(tmp_path), init=False, timeout=TIMEOUT)
    assert [r[3] for r in run] == [2 if kind == "z2" else 3] * 2  # zero_ext's engine at that stage
    _same_run(run, ddp)


@pytest.mark.parametrize("kind", ["z2", "z3"])
def test_save_resume_and_convert_to_fp32(site, ddp, ddp_resumed, kind, tmp_path):
    """Saved after step 2 and at the end; resumed from step 2, the run goes on as DDP resumed from its own
    step-2 checkpoint; the converted final checkpoint holds the final weights, with Lightning's entries."""
    full = run_ranks(2, _fit, site, kind, str(tmp_path), STEPS, (2, STEPS), None, True, init=False, timeout=TIMEOUT)
    _same_run(full, ddp)
    middle, converted = full[0][2][2], full[0][4]
    assert os.path.isdir(middle) and all(r[2] == full[0][2] for r in full)
    resumed = run_ranks(2, _fit, site, kind, str(tmp_path / "resumed"), STEPS, (), middle, init=False,
                        timeout=TIMEOUT)
    assert all(len(r[0]) == STEPS - 2 for r in resumed)
    _same_run(resumed, ddp_resumed)
    weights = full[0][1]
    assert sorted(converted["state_dict"]) == sorted(weights)
    for n, w in weights.items():
        assert converted["state_dict"][n].dtype == torch.float32 and torch.equal(converted["state_dict"][n], w), n
    assert converted["global_step"] == STEPS and "optimizer_states" not in converted
