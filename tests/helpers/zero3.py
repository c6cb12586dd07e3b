"""Models and helpers shared by the ZeRO-3 parameter-layer tests (tests/test_zero_*.py). No tests here.

Every helper runs inside a rank (through harness.run_ranks) unless it says otherwise.
"""
import dataclasses
from typing import Dict

import torch
from torch import nn


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def full_values(model: nn.Module) -> Dict[str, torch.Tensor]:
    """name -> full value of every parameter (ZeRO-3 ones gathered; collective)."""
    import zero_ext.zero as zero

    with zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def same_tensors(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> list:
    """Names whose tensors differ (or exist on one side only); [] when bit-identical."""
    bad = sorted(set(a) ^ set(b))
    bad += [n for n in sorted(set(a) & set(b)) if a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]
    return bad


def grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- models -----------------------------------------------------------------------------------------------

class Block(nn.Module):
    """Two linears and a norm; the norm is built inside a helper called from the constructor."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d + 1)
        self.fc2 = nn.Linear(2 * d + 1, d)
        self.norm = self._make_norm(d)

    @staticmethod
    def _make_norm(d):
        return nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.fc2(torch.tanh(self.fc1(x))))


class Deep(nn.Module):
    """Nesting several levels deep, a ModuleList built from a list comprehension, a root parameter, a
    buffer, and a module without parameters."""

    def __init__(self, d: int = 6, depth: int = 3):
        super().__init__()
        self.embed = nn.Linear(5, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(depth)])
        self.inner = nn.Sequential(nn.Sequential(nn.Linear(d, d), nn.GELU()), nn.Identity())
        self.act = nn.Tanh()
        self.scale = nn.Parameter(torch.randn(d))
        self.register_buffer("shift", torch.linspace(-1, 1, d))

    def forward(self, x):
        h = self.act(self.embed(x))
        for block in self.blocks:
            h = block(h)
        return self.inner(h) * self.scale + self.shift


class Shared(nn.Module):
    """One parameter registered in two modules (b.weight = a.weight), both applied."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: torch.Tensor


class KwargsHead(nn.Module):
    """Called with keyword arguments; returns a dict."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, *, gate=None):
        y = self.proj(x)
        return {"y": y if gate is None else y * gate, "aux": y.sum()}


class TupleBody(nn.Module):
    """Returns a tuple whose second element does not require grad."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, y.detach().argmax(-1)


class ShiftInPlace(nn.Module):
    """Modifies its input in place."""

    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x.add_(self.offset)


class Containers(nn.Module):
    """Kwargs, tuple and dict outputs, a dataclass output, a module without parameters, an in-place
    module."""

    def __init__(self):
        super().__init__()
        self.body = TupleBody()
        self.shift = ShiftInPlace()
        self.head = KwargsHead()
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        h, idx = self.body(x)
        h = self.shift(h * 1.0)
        out = self.head(self.drop(h), gate=torch.sigmoid(x))
        return Out(out["y"], out["aux"] + idx.float().sum() * 0)

    def loss(self, x):
        out = self(x)
        return out.logits.pow(2).mean() + out.extra * 1e-3


def tiny_llama():
    """A 2-layer HF Llama (seeded, eval mode) small enough for generation tests on 2 CPU ranks."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def generate_greedy(model, prompt, new):
    """Exactly ``new`` greedy tokens after ``prompt`` (synced_gpus: every rank runs every step)."""
    out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, synced_gpus=True,
                         pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()
