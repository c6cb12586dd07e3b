"""The demo's corpus as character tokens: a vocabulary of the characters it uses, and random windows.

The last tenth is held out, so the loss the demo reports at the end is on text the model never
trained on (the tail of one essay, so "held out" is a mild claim: same author, same topics).
"""
import torch


class CharCorpus:
    def __init__(self, path: str, held_out: float = 0.1):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor(self.encode(text), dtype=torch.long)
        cut = int(len(ids) * (1 - held_out))
        self.splits = {"train": ids[:cut], "val": ids[cut:]}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str):
        return [self.index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(self, split: str, batch: int, block: int, generator: torch.Generator):
        """(inputs, targets), each (batch, block): random windows and the same windows shifted by one."""
        ids = self.splits[split]
        starts = torch.randint(0, len(ids) - block - 1, (batch,), generator=generator)
        window = torch.stack([ids[s:s + block + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]
