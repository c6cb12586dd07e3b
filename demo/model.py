"""A small GPT for the demo and the step benchmark: token + position embeddings, pre-norm blocks of
causal self-attention and an MLP, and an output head tied to the token embedding.

Plain PyTorch on purpose: the engine must train any nn.Module, so nothing here knows about ZeRO.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):  # x is (B, T, d)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, d/heads)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int = 160, heads: int = 4, layers: int = 4, block: int = 128):
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one (vocab, d) matrix reads and writes tokens
        self.apply(self._init)
        # GPT-2's scaling: the residual stream sums 2 * layers projections, so shrink each one
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):  # idx is (B, T) token ids, T <= block; returns (B, T, vocab) logits
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))

    @torch.no_grad()
    def generate(self, idx, new_tokens: int, temperature: float = 0.8, generator=None):
        """Appends ``new_tokens`` sampled tokens to ``idx`` (B, T); the context is the last ``block``."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block:])[:, -1].float() / temperature
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def lm_loss(logits, target):
    """Next-token cross-entropy, in fp32 whatever the model's dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def count_params(model: nn.Module) -> int:
    """Distinct trainable elements (a tied matrix counts once, as in model.parameters()); a ZeRO-3
    parameter counts its full size (ds_numel), not its empty partitioned shape."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
