"""zero.Init initialises exactly: writes after partitioning reach the full parameters.

A model built under zero.Init must be bit-identical to the same construction without it under rank
0's seed, whatever each rank's seed, and every rank's random generator must end where its plain
construction leaves it (the same numbers drawn, in the same order). The constructions below write to
parameters after they were partitioned, the way real code does: transformers' ``post_init`` (GPT-2 with
tied embeddings, Llama with a padding row), a parent constructor's ``nn.init`` calls, ``self.apply``,
views and ``.data``, code in the ``with`` block after construction, and ``skip_init``.
Outside zero.Init and GatheredParameters such writes raise, naming the parameter.
"""
import pytest
import torch
from torch import nn

from helpers.harness import run_ranks
from helpers.zero3 import full_values, rank, same_tensors


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=32, pad_token_id=3,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


class Inits(nn.Module):
    """A parent initialising its finished children in every way torch offers, and a tied head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=2)
        self.fc = nn.Linear(6, 9)
        self.conv = nn.Conv1d(3, 4, 3)
        self.norm = nn.LayerNorm(9)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.extra = nn.Parameter(torch.empty(5, 3))
        nn.init.xavier_uniform_(self.fc.weight)  # fan from dim()/size(), then uniform_
        nn.init.trunc_normal_(self.extra, std=0.5)  # uniform_, erfinv_, mul_, add_, clamp_
        nn.init.kaiming_normal_(self.conv.weight, nonlinearity="relu")
        nn.init.orthogonal_(self.conv.bias.view(1, 4))  # a view of a partitioned parameter
        self.fc.bias.data.normal_(std=0.1)
        with torch.no_grad():
            self.norm.weight.copy_(torch.linspace(0.5, 1.5, 9))
            self.fc.weight[0] = 0.25  # __setitem__
            self.fc.weight *= 2.0  # __imul__
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Embedding):
            m.weight.data.normal_(std=0.02)
            m.weight.data[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            m.bias.data.uniform_(-0.1, 0.1)


def _custom():
    """Inits, then more writes in the with block: nn.init, copy_, apply, a skip_init module."""
    model = Inits()
    nn.init.normal_(model.fc.bias, mean=1.0)
    with torch.no_grad():
        model.extra.copy_(model.extra * 3 + torch.randn(5, 3))
    model.apply(lambda m: nn.init.ones_(m.weight) if isinstance(m, nn.LayerNorm) else None)
    model.late = torch.nn.utils.skip_init(nn.Linear, 4, 7)
    nn.init.uniform_(model.late.weight)
    nn.init.zeros_(model.late.bias)
    return model


_BUILDERS = {"gpt2": _gpt2, "llama": _llama, "custom": _custom}


def _state(model):
    state = dict(full_values(model))
    state.update({n: b.detach().clone() for n, b in model.named_buffers()})
    return state


def _exact(names):
    import zero_ext.zero as zero

    seed = 7 + 100 * rank()
    out = {}
    for name in names:
        torch.manual_seed(seed)
        plain = _BUILDERS[name]()
        plain_rng = torch.get_rng_state()
        torch.manual_seed(seed)
        with zero.Init():
            model = _BUILDERS[name]()
        rng = torch.get_rng_state()
        out[name] = {
            "state": _state(model), "plain": _state(plain) if rank() == 0 else None,
            "rng_follows_plain": torch.equal(rng, plain_rng),
            "whole": [n for n, p in model.named_parameters() if not zero.is_zero_param(p)],
            "still_gathered": [n for n, p in model.named_parameters() if p.ds_status.name != "NOT_AVAILABLE"],
            "tied": (model.lm_head.weight is model.transformer.wte.weight if name == "gpt2"
                     else model.head.weight is model.embed.weight if name == "custom" else None),
        }
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_models_built_under_init_are_bit_identical_to_plain_construction(world):
    names = list(_BUILDERS)
    results = run_ranks(world, _exact, names, timeout=300)
    for name in names:
        reference = results[0][name]["plain"]
        for r, res in enumerate(results):
            got = res[name]
            assert same_tensors(reference, got["state"]) == [], f"rank {r}: {name}"
            assert got["rng_follows_plain"], f"rank {r}: {name} drew random numbers differently"
            assert got["whole"] == [] and got["still_gathered"] == [], f"rank {r}: {name}"
            assert got["tied"] in (True, None)
    # the controls: the writes after partitioning did change values (zero.Init would be lost without them)
    custom = results[0]["custom"]["plain"]
    assert torch.all(custom["embed.weight"][2] == 0) and custom["embed.weight"].std() < 0.05
    assert torch.equal(custom["norm.weight"], torch.ones(9)) and custom["fc.bias"].mean() > 0.5
    assert results[0]["gpt2"]["plain"]["transformer.wte.weight"].std() < 0.05  # post_init's std 0.02, not 1
    assert torch.all(results[0]["llama"]["plain"]["model.embed_tokens.weight"][3] == 0)  # padding row


# -- the write guard -----------------------------------------------------------------------------------

def _refused(write):
    import zero_ext.zero as zero

    try:
        write()
    except zero.PartitionedWriteError as exc:
        return str(exc)
    return "no error"


def _guard():
    import zero_ext.zero as zero

    with zero.Init():
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    w, b = model[0].weight, model[0].bias
    before = {n: p.ds_tensor.clone() for n, p in model.named_parameters()}
    other = torch.zeros(3, 4)
    with torch.no_grad():
        messages = {
            "normal_": _refused(lambda: w.normal_()),
            "data.zero_": _refused(lambda: w.data.zero_()),
            "copy_": _refused(lambda: w.copy_(other)),
            "nn.init.normal_": _refused(lambda: nn.init.normal_(w)),
            "nn.init.zeros_": _refused(lambda: nn.init.zeros_(b)),
            "setitem": _refused(lambda: w.__setitem__(0, 1.0)),
            "iadd": _refused(lambda: w.__iadd__(1.0)),
            "data=": _refused(lambda: setattr(w, "data", other)),
            "nn.init.trunc_normal_": _refused(lambda: nn.init.trunc_normal_(b)),
        }
    allowed = {}
    w.requires_grad_(False)  # metadata, not values
    allowed["requires_grad_"] = w.requires_grad is False
    model.to("cpu")  # sets empty data
    allowed["reads"] = (tuple(w.shape), w.dtype, tuple(w.detach().shape))
    other.copy_(torch.ones(3, 4))
    allowed["copy_into_another"] = float(other.sum())
    with zero.GatheredParameters([w, b], modifier_rank=0):
        allowed["gathered_class"] = type(w) is nn.Parameter
        with torch.no_grad():
            w.fill_(2.0)
            b.data.zero_()
    allowed["partitioned_class"] = type(w) is not nn.Parameter and isinstance(w, nn.Parameter)
    unchanged = [n for n, p in model.named_parameters() if n.startswith("1.") and not torch.equal(p.ds_tensor, before[n])]
    return messages, allowed, unchanged, w.ds_tensor.tolist()


def test_writes_to_partitioned_parameters_outside_init_are_refused_by_name():
    for r, (messages, allowed, unchanged, piece) in enumerate(run_ranks(2, _guard)):
        for what, text in messages.items():
            assert "GatheredParameters(" in text and "modifier_rank" in text, f"{what}: {text}"
            assert "Linear.weight" in text or "Linear.bias" in text, f"{what}: {text}"
        assert allowed == {"requires_grad_": True, "reads": ((0,), torch.float32, (0,)), "copy_into_another": 12.0,
                           "gathered_class": True, "partitioned_class": True}
        assert unchanged == []
        assert piece == [2.0] * 6  # the write inside GatheredParameters was kept
