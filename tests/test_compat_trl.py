"""TRL's generation path on zero_ext's ZeRO-3 engine, through the `deepspeed` compatibility package.

TRL's ``unwrap_model_for_generation`` (GRPO, RLOO, GKD and online DPO generate through it) gathers the
whole model, removes DeepSpeed's hooks through ``engine.optimizer.parameter_offload``, generates, and
adds them back (zero_ext/zero/ds_surface.py). On 2 gloo CPU ranks, an accelerate-prepared ZeRO-3 engine
after one training pass: inside TRL's block (and DeepSpeed's own ``deepspeed.runtime.zero.
unwrap_model_for_generation``) each rank -- own prompt, own number of new tokens, so the ranks run
different numbers of forwards -- generates exactly the tokens of the unpartitioned model holding the
same weights; the hooks are off inside and back afterwards, and training goes on.

The set-up (compat installed into a folder of the test's own, accelerate's state made with gloo) is
tests/test_compat_hf_trainer.py's.
"""
import importlib.util

import pytest

from helpers.compat_site import install_compat
from helpers.harness import run_ranks
from test_compat_hf_trainer import (_deepspeed_state_on_cpu, _quiet, _reset_accelerate, _tiny_gpt2, _Tokens,
                                    _use_compat)

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate", "trl")),
    reason="needs transformers, accelerate and trl (scripts/setup.sh installs them)")

TIMEOUT = 300


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_compat(str(tmp_path_factory.mktemp("compat")))


def _train_pass(accelerator, model, optimizer, loader):
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _generate(model, prompt, new):
    out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, synced_gpus=False,
                         pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def _unwrap_case(site_dir):
    _use_compat(site_dir)
    _quiet()
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.zero import unwrap_model_for_generation as ds_unwrap
    from trl.models.utils import unwrap_model_for_generation

    _reset_accelerate()
    _deepspeed_state_on_cpu()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=2)
    plain = _tiny_gpt2()
    model, optimizer, loader = accelerator.prepare(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), loader)
    model.eval()  # no dropout: generation is compared with the plain model's
    _train_pass(accelerator, model, optimizer, loader)
    reference = _tiny_gpt2().eval()
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.module.parameters())):  # the trained weights, whole
        reference.load_state_dict({k: v.clone() for k, v in model.module.state_dict().items()})

    r = dist.get_rank()
    prompt = torch.randint(1, 64, (1, 2 + 3 * r), generator=torch.Generator().manual_seed(5 + r))
    new = 3 + 4 * r
    expected = _generate(reference, prompt, new)
    offload = model.optimizer.parameter_offload
    with unwrap_model_for_generation(model, accelerator) as unwrapped:
        trl_tokens = _generate(unwrapped, prompt, new)
        hooks_inside = (len(offload.forward_hooks), sum(len(m._forward_pre_hooks) for m in unwrapped.modules()))
    with ds_unwrap(model):
        ds_tokens = _generate(model.module, prompt, new)
        ds_hooks_inside = len(offload.forward_hooks)
    hooks_after = (len(offload.forward_hooks), model.zero_model.hooks_active)
    losses = _train_pass(accelerator, model, optimizer, loader)  # training goes on, with the hooks
    model.destroy()
    _reset_accelerate()
    return expected, trl_tokens, ds_tokens, hooks_inside, ds_hooks_inside, hooks_after, losses


def test_trl_unwrap_model_for_generation_generates_the_unpartitioned_tokens(site):
    for expected, trl_tokens, ds_tokens, hooks_inside, ds_hooks_inside, hooks_after, losses in run_ranks(
            2, _unwrap_case, site, timeout=TIMEOUT):
        assert trl_tokens == expected and ds_tokens == expected
        assert hooks_inside == (0, 0) and ds_hooks_inside == 0
        assert hooks_after == (1, True)
        assert all(loss == loss for loss in losses) and len(losses) == 4


# -- SFTTrainer at ZeRO-3 against DDP ------------------------------------------------------------------------

def _word_tokenizer():
    """A word-level tokenizer over a 60-word vocabulary, built offline (no hub download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _sft(site_dir, out_dir, ds_config):
    """TRL's SFTTrainer on 16 random 'sentences' for 4 optimizer steps (micro batch 2, accumulation 2, 2
    ranks); returns the logged losses."""
    _use_compat(site_dir)
    _quiet()
    import random

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    _reset_accelerate()
    extra = _deepspeed_state_on_cpu() if ds_config is not None else {"use_cpu": True}
    rng = random.Random(0)
    texts = [" ".join(f"w{rng.randrange(61)}" for _ in range(12)) for _ in range(16)]
    args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                     learning_rate=1e-3, logging_steps=1, report_to=[], seed=0, data_seed=0, disable_tqdm=True,
                     save_strategy="no", deepspeed=ds_config, dataloader_pin_memory=False, max_length=16, bf16=False,
                     **extra)
    trainer = SFTTrainer(model=_tiny_gpt2(), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=_word_tokenizer())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    _reset_accelerate()
    return losses


def test_trl_sft_trainer_zero3_matches_ddp(site, tmp_path):
    from test_compat_hf_trainer import ZERO3

    ddp = run_ranks(2, _sft, site, str(tmp_path / "ddp"), None, timeout=TIMEOUT)[0]
    zero3 = run_ranks(2, _sft, site, str(tmp_path / "z3"), ZERO3, timeout=TIMEOUT)[0]
    assert len(ddp) == 4 and len(zero3) == 4
    for a, b in zip(zero3, ddp):
        assert abs(a - b) <= 1e-5 * abs(b), (zero3, ddp)
