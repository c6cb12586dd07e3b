"""Generation under ZeRO-3 (zero_ext/zero/generation.py, [Note: whole-model gathered] in model.py, and
the forward-only repetition of the trace in coordinator.py), on 2 gloo ranks.

- HF ``generate`` (greedy) on a tiny GPT-2 and a tiny Llama from transformers, each rank with its own
  prompt, prompt length and number of new tokens: partitioned (``synced_gpus=True``), inside
  ``GatheredParameters(model.parameters())`` and inside ``zero.generation`` (both ``synced_gpus=False``:
  the ranks run different numbers of forwards) generate exactly the tokens of the unpartitioned model;
  inside the whole-model blocks no fetch-order agreement runs and no module hook is installed; the hooks
  are back afterwards and a training step still matches;
- partitioned decoding gathers each parameter once: forwards without autograd repeat the trace, and
  what they reuse stays gathered from one to the next; a rank-dependent branch in such a forward still
  raises FetchOrderError on every rank;
- ``zero.generation`` refuses on every rank, naming the bytes, when one rank's budget is too small;
- the external-parameter detector runs in the trace-recording step only, and tied weights still work.
"""
import importlib.util

import pytest
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.zero3 import rank

HAS_HF = importlib.util.find_spec("transformers") is not None
TIMEOUT = 240


def _hf_model(kind: str):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
        return LlamaForCausalLM(cfg).eval()
    cfg = GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def _generate(model, prompt, new, synced):
    out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, synced_gpus=synced,
                         pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def _generation_case(kind):
    import zero_ext
    from zero_ext.zero import GatheredParameters, ZeroParamStatus, fetch, generation, zero_param_of

    r = rank()
    prompt = torch.randint(1, 96, (1, 3 + 4 * r), generator=torch.Generator().manual_seed(7 + r))
    new = 4 + 5 * r  # rank 1 generates more tokens than rank 0
    expected = _generate(_hf_model(kind), prompt, new, synced=False)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = zero_ext.initialize(model=_hf_model(kind), config=cfg)[0]
    model, zm = engine.module, engine.zero_model
    got = {"partitioned": _generate(model, prompt, new, synced=True)}
    seen = {}
    for label, block in (("gathered", lambda: GatheredParameters(list(model.parameters()))),
                         ("generation", lambda: generation(engine))):
        with block():  # (entering runs one agreement: ranks must enter the same block, test_engine_rank_faults)
            before = fetch.agreements()
            hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
            got[label] = _generate(model, prompt, new, synced=False)
            seen[label] = (fetch.agreements() - before, hooks)
    # what the blocks gathered is given back (the coordinator may keep what the next decoding step reuses)
    partitioned_after = all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE or zero_param_of(p).holders
                            for p in model.parameters())
    partitioned_after &= not any(isinstance(h, GatheredParameters) for p in model.parameters()
                                 for h in zero_param_of(p).holders)
    # the hooks are back: a training step on the engine matches the same step on the plain model
    plain = _hf_model(kind)  # eval mode (no dropout), so that the losses are comparable
    ids = torch.randint(1, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    ref = plain(input_ids=ids, labels=ids).loss.item()
    engine.destroy()
    return expected, got, seen, zm.hooks_active, partitioned_after, loss.item(), ref


@pytest.mark.skipif(not HAS_HF, reason="needs transformers")
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generated_tokens_match_the_unpartitioned_model(kind):
    for expected, got, seen, hooks_back, partitioned_after, loss, ref in run_ranks(2, _generation_case, kind,
                                                                                 timeout=TIMEOUT):
        assert got == {"partitioned": expected, "gathered": expected, "generation": expected}
        for label, (agreements, hooks) in seen.items():
            assert agreements == 0, (label, agreements)  # no collective of ours inside the whole-model block
            assert hooks == 0, (label, hooks)  # the module hooks are off: a forward is the plain module's
        assert hooks_back and partitioned_after
        assert abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)


# -- partitioned decoding: the trace repeated ----------------------------------------------------------

class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.odd_rank_branch = False

    def forward(self, x):
        x = torch.tanh(self.a(x))
        if self.odd_rank_branch and rank() == 1:
            x = self.c(x)
        return self.b(x)


def _repeat_case():
    import zero_ext
    from zero_ext.zero import FetchOrderError, ZeroModel

    torch.manual_seed(0)
    model = _Branchy()
    plain = _Branchy()
    plain.load_state_dict(model.state_dict())
    zm = ZeroModel(model, param_persistence_threshold=0)
    x = torch.randn(2, 8)
    gathers, outs = [], []
    with torch.no_grad():
        for _ in range(5):
            outs.append(torch.equal(model(x), plain(x)))
            gathers.append(zm.meter.gathers)
        model.odd_rank_branch = True
        try:
            model(x)
            raised = None
        except FetchOrderError as exc:
            raised = str(exc)
    zm.destroy()
    # under a max_live_parameters that holds one weight (64 elements) and its bias: kept within it
    limited = _Branchy()
    limited.load_state_dict(plain.state_dict())
    zm = ZeroModel(limited, param_persistence_threshold=0, max_live_parameters=80)
    with torch.no_grad():
        limited_outs = [torch.equal(limited(x), plain(x)) for _ in range(4)]
    peak = zm.meter.peak
    zm.destroy()
    del zero_ext
    return gathers, outs, raised, limited_outs, peak


def test_forwards_without_autograd_repeat_the_trace_and_gather_once():
    for gathers, outs, raised, limited_outs, peak in run_ranks(2, _repeat_case, timeout=60):
        assert all(outs) and all(limited_outs)
        # step 1 records (gathering on demand), step 2 follows the trace and keeps what the next repeats
        assert gathers[2] == gathers[3] == gathers[4] > 0, gathers
        assert raised is not None and "rank 0" in raised and "rank 1" in raised
        assert peak <= 80 + 72, peak  # the limit, plus the running module's own parameters


# -- the memory check ----------------------------------------------------------------------------------

def _refuse_case():
    import zero_ext
    from zero_ext.zero import GenerationMemoryError, ZeroModel, generation

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    zm = ZeroModel(model, param_persistence_threshold=0)
    need = 2 * (64 * 64 + 64) * 4  # fp32, 2 ranks: no padding
    try:
        with generation(model, max_bytes=need if rank() == 0 else need - 1):
            pass
        message = None
    except GenerationMemoryError as exc:
        message = str(exc)
    with generation(model, max_bytes=need) as m:  # it fits: gathered whole
        whole = [p.numel() for p in m.parameters()]
    zm.destroy()
    del zero_ext
    return message, need, whole


def test_generation_mode_refuses_on_every_rank_naming_the_bytes():
    for message, need, whole in run_ranks(2, _refuse_case, timeout=60):
        assert message is not None and f"rank 1 needs {need} bytes" in message and "rank 0" not in message
        assert whole == [64 * 64, 64, 64 * 64, 64]


# -- the detector runs while the trace is recorded ---------------------------------------------------

class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)

    def forward(self, ids):
        return torch.tanh(self.mid(self.embed(ids))) @ self.embed.weight.t()  # the embedding used again


def _detector_case():
    import zero_ext
    from zero_ext.zero import ZeroModel

    torch.manual_seed(0)
    model, plain = _Tied(), _Tied()
    plain.load_state_dict(model.state_dict())
    zm = ZeroModel(model, param_persistence_threshold=0)
    detecting = []
    model.mid.register_forward_hook(lambda *a: detecting.append(zm.detecting))
    ids = torch.tensor([[1, 2, 3]])
    same = []
    for _ in range(4):
        out = model(ids)
        out.pow(2).sum().backward()
        ref = plain(ids)
        ref.pow(2).sum().backward()
        same.append(torch.equal(out, ref))
    zm.destroy()
    grads_equal = torch.equal(model.embed.weight.grad, plain.embed.weight.grad)
    del zero_ext
    return detecting, same, grads_equal, zm.coordinator.stats.recorded


def test_detector_runs_in_recording_steps_only_and_tied_weights_still_work():
    for detecting, same, grads_equal, recorded in run_ranks(2, _detector_case, timeout=60):
        assert all(same) and grads_equal
        # step 1 records (the tied use is detected and registered); the registration changes the next
        # step's fetches, so step 2 leaves the trace and step 3 records again; step 4 follows it
        assert (detecting, recorded) == ([True, False, True, False], 2)


# -- a training step inside a whole-model block ---------------------------------------------------------

def _train_inside_case():
    import zero_ext
    from zero_ext.zero import GatheredParameters

    torch.manual_seed(0)
    model, plain = _Branchy(), _Branchy()
    plain.load_state_dict(model.state_dict())
    # no weight decay: the unused branch (c) has no gradient in plain PyTorch, which AdamW then skips
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = zero_ext.initialize(model=model, config=cfg)[0]
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    xs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * s + r)) for s in range(3) for r in (0, 1)]
    for s in range(3):
        x = xs[2 * s + rank()]
        if s == 1:  # the middle step inside a block holding every parameter: the hooks are off
            with GatheredParameters(list(model.parameters())):
                engine.backward(engine(x).pow(2).mean())
        else:
            engine.backward(engine(x).pow(2).mean())
        engine.step()
        both = torch.cat([xs[2 * s], xs[2 * s + 1]])
        plain(both[:2]).pow(2).mean().mul(0.5).add(plain(both[2:]).pow(2).mean().mul(0.5)).backward()
        opt.step()
        opt.zero_grad()
    with GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
    engine.destroy()
    return diff


def test_a_training_step_inside_a_whole_model_block_still_reduces_gradients():
    for diff in run_ranks(2, _train_inside_case, timeout=60):
        assert diff <= 1e-5, diff
