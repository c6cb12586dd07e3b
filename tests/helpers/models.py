"""Small models for engine tests: an MLP (frozen layer, two param groups, a layer used twice, sizes not
divisible by the world size) and a tiny transformer language model (tied embedding / output weight)."""
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in=7, hidden=13, d_out=5):
        super().__init__()
        self.frozen = nn.Linear(d_in, hidden)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(hidden, hidden)  # applied twice per forward
        self.head = nn.Linear(hidden, d_out)
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, d_out))

    def forward(self, x):
        h = torch.tanh(self.frozen(x))
        h = torch.tanh(self.body(h))
        h = torch.tanh(self.body(h))
        return self.head(h) + self.offset

    def loss(self, batch):
        x, y = batch
        return (self(x) - y).pow(2).mean()

    @staticmethod
    def batch(n, generator, dtype=torch.float32):
        x = torch.randn(n, 7, generator=generator)
        y = torch.randn(n, 5, generator=generator)
        return x.to(dtype), y.to(dtype)

    def param_groups(self):
        """Two groups with different lr and weight decay (the frozen layer sits in the first)."""
        return [{"params": list(self.frozen.parameters()) + list(self.body.parameters()), "lr": 2e-2,
                 "weight_decay": 0.0},
                {"params": list(self.head.parameters()), "lr": 1e-2, "weight_decay": 0.1}]


class TinyGPT(nn.Module):
    def __init__(self, vocab=37, d=16, heads=2, layers=2, block=9):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(block, d) * 0.02)
        # no biases: attention's key bias has a true gradient of exactly 0, so its computed gradient is
        # rounding noise that Adam turns into +-lr steps; no two reduction orders agree on it
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=3 * d, dropout=0.0, batch_first=True,
                                           bias=False)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.tok.weight  # tied
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block))

    def forward(self, idx):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t].to(h.dtype), is_causal=True)
        return self.out(self.norm(h))

    def loss(self, batch):
        idx, target = batch
        logits = self(idx)
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))

    @staticmethod
    def batch(n, generator, dtype=None):
        idx = torch.randint(0, 37, (n, 9), generator=generator)
        return idx, torch.roll(idx, -1, dims=1)

    def param_groups(self):
        return [{"params": list(self.parameters())}]


class Branchy(nn.Module):
    """Takes a different branch on different steps (decided by the data, the same on every rank)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 9)
        self.left = nn.Linear(9, 9)
        self.right = nn.Sequential(nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 9))
        self.head = nn.Linear(9, 5)

    def forward(self, x, go_left):
        h = torch.tanh(self.inp(x))
        h = self.left(h) if go_left else self.right(h)
        return self.head(torch.tanh(h))

    def loss(self, batch):
        x, y, go_left = batch
        return (self(x, go_left) - y).pow(2).mean()

    @staticmethod
    def batch(n, generator, dtype=torch.float32):
        x, y = MLP.batch(n, generator, dtype)
        return x, y, bool(torch.randint(0, 2, (1,), generator=generator).item())

    def param_groups(self):
        return [{"params": list(self.parameters())}]


MODELS = {"mlp": MLP, "gpt": TinyGPT, "branchy": Branchy}
