"""Hugging Face transformers + accelerate on zero_ext, through the `deepspeed` compatibility package.

The package (compat/) is installed with pip into a folder of this test's own, which each rank puts
first on sys.path: transformers and accelerate then find a `deepspeed` module *and* distribution, as
they require, and take their DeepSpeed path. Everything runs on 2 gloo CPU ranks (tests/helpers/harness.py),
with a GPT-2 of 2 layers and 32 channels.

Cases: Trainer at ZeRO-2 and at ZeRO-3 ("auto" values, a from_pretrained model) against DDP; checkpoint
save and resume; evaluate() under ZeRO-3; from_pretrained under ZeRO-3 (HfDeepSpeedConfig -> zero.Init);
a plain accelerate loop's save_state/load_state; what the libraries check to find DeepSpeed.

Loss parity: HF's Trainer logs the loss of every optimizer step averaged over the ranks; with ZeRO-2
and ZeRO-3 it must equal the loss of the same Trainer run under plain DDP (no DeepSpeed) within a
relative 1e-5 (fp32; the sums run in a different order, nothing else differs).

The CPU set-up: without a GPU accelerate picks no process-group backend when DeepSpeed is on and runs
each rank as a world of one, so the ranks make accelerate's state themselves first with backend gloo
(_deepspeed_state_on_cpu, the recipe README.md gives); with a GPU nothing of this is needed.
"""
import importlib.util
import os
import sys

import pytest

from helpers.compat_site import install_compat
from helpers.harness import run_ranks

# Only looked up, not imported: the ranks unpickle this module, and accelerate decides at import time
# whether DeepSpeed is there, so it must first be imported after _use_compat.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="needs transformers and accelerate (scripts/setup.sh installs them)")

TIMEOUT = 300  # the first case imports transformers on each rank (many seconds on a loaded machine)
RTOL = 1e-5

ZERO2 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}
# ZeRO-3 with every value HF's Trainer can fill in left as "auto", and the optimizer from the config
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "train_batch_size": "auto", "gradient_clipping": "auto",
         "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto"}},
         "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                               "stage3_param_persistence_threshold": "auto",
                               "stage3_gather_16bit_weights_on_model_save": True}}


# -- the compat package, installed --------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A folder holding the compat package as pip installs it."""
    return install_compat(str(tmp_path_factory.mktemp("compat")))


def _use_compat(site_dir):
    if site_dir not in sys.path:
        sys.path.insert(0, site_dir)
    import deepspeed

    # this folder's copy, or (where scripts/setup.sh installed it in editable mode) the checkout's: zero_ext's
    assert "+zeroext" in deepspeed.__version__, (deepspeed.__file__, deepspeed.__version__)


def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


# -- a Trainer run on each rank --------------------------------------------------------------------------

def _tiny_gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class _Tokens:
    """16 sequences of 16 random tokens, each its own label (a torch Dataset)."""

    def __init__(self):
        import torch

        self.x = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # Accelerator(deepspeed_plugin=...) sets it and leaves it


def _deepspeed_state_on_cpu():
    """accelerate's state for DeepSpeed on gloo (see the module docstring); TrainingArguments then
    takes it with accelerator_config={"use_configured_state": True}."""
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return {"accelerator_config": {"use_configured_state": True}}


def _train(site_dir, out_dir, ds_config, save_steps=None, resume=None, pretrained=False):
    """Trains the tiny GPT-2 for 4 optimizer steps (micro batch 2, accumulation 2, 2 ranks); returns the
    losses the Trainer logged, the kind of wrapper it trained and the engine's ZeRO stage. ``pretrained``:
    rank 0 saves the model first, and every rank loads it with from_pretrained after the TrainingArguments
    exist (under a ZeRO-3 config: built partitioned by deepspeed.zero.Init, rank 0 copying the weights in)."""
    _use_compat(site_dir)
    _quiet()
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    _reset_accelerate()
    extra = _deepspeed_state_on_cpu() if ds_config is not None else {"use_cpu": True}  # DDP on gloo
    path = os.path.join(out_dir, "pretrained")
    if pretrained:
        if dist.get_rank() == 0:
            _tiny_gpt2().save_pretrained(path)
        dist.barrier()
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
        learning_rate=1e-3, logging_steps=1, report_to=[], seed=0, data_seed=0, disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, deepspeed=ds_config,
        dataloader_pin_memory=False, **extra)
    model = GPT2LMHeadModel.from_pretrained(path) if pretrained else _tiny_gpt2()
    partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    wrapped = trainer.model_wrapped
    stage = wrapped.zero_optimization_stage() if hasattr(wrapped, "zero_optimization_stage") else None
    kind = type(wrapped).__name__
    if hasattr(wrapped, "destroy"):
        wrapped.destroy()
    _reset_accelerate()
    return losses, kind, (stage, partitioned)


@pytest.fixture(scope="module")
def ddp_losses(site, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp"))
    results = run_ranks(2, _train, site, out, None, init=False, timeout=TIMEOUT)
    losses, kind, _ = results[0]
    assert kind == "DistributedDataParallel" and len(losses) == 4
    return losses


@pytest.fixture(scope="module")
def zero3_run(site, tmp_path_factory):
    """The ZeRO-3 run of a model loaded with from_pretrained (built partitioned), saving a checkpoint
    every 2 steps (the resume test starts from the first one)."""
    out = str(tmp_path_factory.mktemp("zero3"))
    return out, run_ranks(2, _train, site, out, ZERO3, 2, pretrained=True, init=False, timeout=TIMEOUT)


def test_trainer_zero2_matches_ddp(site, ddp_losses, tmp_path):
    for losses, kind, stage in run_ranks(2, _train, site, str(tmp_path), ZERO2, init=False, timeout=TIMEOUT):
        assert (kind, stage) == ("ZeroEngine", (2, False))
        assert losses == pytest.approx(ddp_losses, rel=RTOL)


def test_trainer_zero3_with_auto_values_on_a_from_pretrained_model_matches_ddp(zero3_run, ddp_losses):
    _, results = zero3_run
    for losses, kind, stage in results:
        assert (kind, stage) == ("ZeroEngine", (3, True))  # the model was partitioned as it was built
        assert losses == pytest.approx(ddp_losses, rel=RTOL)


def test_trainer_checkpoint_save_and_resume(site, zero3_run):
    out, results = zero3_run
    full = results[0][0]
    ckpt = os.path.join(out, "checkpoint-2")
    saved = set(os.listdir(ckpt))
    # the 16-bit weights gathered from the partitions (stage3_gather_16bit_weights_on_model_save), the
    # engine's checkpoint (every rank's shard) and the Trainer's own state
    assert {"model.safetensors", "latest", "global_step2", "trainer_state.json"} <= saved, saved
    for losses, kind, stage in run_ranks(2, _train, site, out, ZERO3, 2, ckpt, pretrained=True, init=False,
                                         timeout=TIMEOUT):
        # the log history of steps 1-2 comes back from the checkpoint; steps 3-4 are trained again and give the
        # uninterrupted run's losses
        assert losses == pytest.approx(full, rel=RTOL)


def _saved_weights_match_gathered(site_dir, ckpt):
    """Whether each tensor of the model.safetensors a ZeRO-3 Trainer checkpoint holds has its full shape
    (gathered, not this rank's partition)."""
    _use_compat(site_dir)
    from safetensors.torch import load_file

    sd = load_file(os.path.join(ckpt, "model.safetensors"))
    ref = _tiny_gpt2().state_dict()
    return {k: tuple(v.shape) == tuple(ref[k].shape) for k, v in sd.items()}


def test_trainer_zero3_checkpoint_holds_full_16bit_weights(site, zero3_run):
    out, _ = zero3_run
    shapes = run_ranks(2, _saved_weights_match_gathered, site, os.path.join(out, "checkpoint-2"), init=False,
                       timeout=TIMEOUT)[0]
    assert shapes and all(shapes.values()), shapes


def _evaluate(site_dir, out_dir, ds_config):
    """Trainer.evaluate() before any training: under ZeRO-3 transformers builds a forward-only engine
    (deepspeed_init(inference=True): no optimizer, no scheduler)."""
    _use_compat(site_dir)
    _quiet()
    from transformers import Trainer, TrainingArguments

    _reset_accelerate()
    extra = _deepspeed_state_on_cpu() if ds_config is not None else {"use_cpu": True}
    args = TrainingArguments(output_dir=out_dir, per_device_eval_batch_size=4, report_to=[], disable_tqdm=True,
                             deepspeed=ds_config, dataloader_pin_memory=False, **extra)
    trainer = Trainer(model=_tiny_gpt2(), args=args, eval_dataset=_Tokens())
    loss = trainer.evaluate()["eval_loss"]
    wrapped = trainer.model_wrapped
    optimizer = getattr(wrapped, "optimizer", "none") if hasattr(wrapped, "zero_optimization_stage") else "ddp"
    if hasattr(wrapped, "destroy"):
        wrapped.destroy()
    _reset_accelerate()
    return loss, optimizer


def test_trainer_evaluate_under_zero3_matches_ddp(site, tmp_path):
    (plain, _), _ = run_ranks(2, _evaluate, site, str(tmp_path), None, init=False, timeout=TIMEOUT)
    for loss, optimizer in run_ranks(2, _evaluate, site, str(tmp_path), ZERO3, init=False, timeout=TIMEOUT):
        assert optimizer is None  # a forward-only engine
        assert loss == pytest.approx(plain, rel=RTOL)


# -- accelerate without the Trainer -------------------------------------------------------------------------

def _accelerate_pass(accelerator, model, optimizer, loader):
    import torch

    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}


def _prepared(stage):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    _reset_accelerate()
    _deepspeed_state_on_cpu()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": stage == 3}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = _tiny_gpt2()
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=2)
    return (accelerator, *accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader))


def _accelerate_save_and_load_state(site_dir, out_dir, stage):
    """A plain accelerate loop (prepare, accumulate, backward, step): one pass, save_state, a second pass;
    then a fresh Accelerator and engine load_state and run the second pass again."""
    _use_compat(site_dir)
    _quiet()
    accelerator, model, optimizer, loader = _prepared(stage)
    _accelerate_pass(accelerator, model, optimizer, loader)
    accelerator.save_state(os.path.join(out_dir, "state"))
    after_two = _accelerate_pass(accelerator, model, optimizer, loader)
    steps = model.global_steps
    model.destroy()
    accelerator, model, optimizer, loader = _prepared(stage)
    accelerator.load_state(os.path.join(out_dir, "state"))
    again = _accelerate_pass(accelerator, model, optimizer, loader)
    diff = max((again[k] - v).abs().max().item() for k, v in after_two.items())
    model.destroy()
    _reset_accelerate()
    return steps, diff


@pytest.mark.parametrize("stage", [0, 2, 3])  # (0: the base optimizer handed out, as DeepSpeed)
def test_accelerate_loop_save_state_and_load_state(site, tmp_path, stage):
    for steps, diff in run_ranks(2, _accelerate_save_and_load_state, site, str(tmp_path), stage, init=False,
                                 timeout=TIMEOUT):
        assert steps == 4  # 2 passes of 4 micro batches, accumulating 2
        assert diff < 1e-6


# -- from_pretrained under ZeRO-3 (HfDeepSpeedConfig -> zero.Init) -----------------------------------------

def _from_pretrained_zero3(site_dir, path):
    """Rank 0 saves a model to `path`; each rank loads it plainly, then under ZeRO-3 (HfDeepSpeedConfig alive: from_pretrained builds the model
    under deepspeed.zero.Init and rank 0 copies the checkpoint in through GatheredParameters); compares
    the gathered weights and a forward-only engine's logits with the plain model's."""
    _use_compat(site_dir)
    _quiet()
    import torch
    import deepspeed
    from transformers import GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    _reset_accelerate()
    deepspeed.init_distributed(dist_backend="gloo")
    if deepspeed.comm.get_rank() == 0:
        model = _tiny_gpt2()
        with torch.no_grad():  # weights unlike a fresh init, so that loading them is visible
            for p in model.parameters():
                p.add_(0.5)
        model.save_pretrained(path)
    deepspeed.comm.barrier()
    plain = GPT2LMHeadModel.from_pretrained(path)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = plain(x).logits
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - must stay alive while from_pretrained runs
    assert is_deepspeed_zero3_enabled()
    model = GPT2LMHeadModel.from_pretrained(path)
    partitioned = all(hasattr(p, "ds_id") and p.ds_tensor.numel() < p.ds_numel for p in model.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        diff = max((v - plain.state_dict()[k]).abs().max().item() for k, v in model.state_dict().items())
    engine = deepspeed.initialize(model=model, config=config)[0]
    with torch.no_grad():
        logits_diff = (engine(x).logits - want).abs().max().item()
    engine.destroy()
    del keep
    _reset_accelerate()
    return partitioned, diff, logits_diff


def test_from_pretrained_under_zero3_loads_the_saved_weights(site, tmp_path):
    for partitioned, diff, logits_diff in run_ranks(2, _from_pretrained_zero3, site, str(tmp_path), init=False,
                                                   timeout=TIMEOUT):
        assert partitioned
        assert diff == 0.0  # copied, not recomputed
        assert logits_diff < 1e-5


# -- what transformers and accelerate check before their DeepSpeed path -------------------------------------

def _probe(site_dir):
    _use_compat(site_dir)
    import importlib.metadata

    import deepspeed
    from accelerate.utils import is_deepspeed_available as accelerate_sees
    from accelerate.utils.versions import compare_versions
    from transformers.integrations.deepspeed import is_deepspeed_available as transformers_sees
    from transformers.utils.versions import require_version

    require_version("deepspeed>=0.9.3")  # transformers' dep_version_check
    return {"version": importlib.metadata.version("deepspeed"), "module_version": deepspeed.__version__,
            "transformers": transformers_sees(), "accelerate": accelerate_sees(),
            "new_enough": compare_versions("deepspeed", ">=", "0.9.3")}


def test_transformers_and_accelerate_detect_the_compat_package(site):
    found = run_ranks(2, _probe, site, init=False, timeout=TIMEOUT)[0]
    assert found == {"version": "0.19.6+zeroext.0.1.0", "module_version": "0.19.6+zeroext.0.1.0",
                     "transformers": True, "accelerate": True, "new_enough": True}
