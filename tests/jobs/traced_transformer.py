"""A small Transformer (embedding, residual stream, self-attention), cut on the traced graph in 3."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp


class Transformer(nn.Module):
    def __init__(self, vocab=40, width=32, depth=3, classes=5):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, width), nn.Parameter(torch.randn(12, width) * 0.02)
        # bias=False: the key projection's bias has a zero gradient in exact arithmetic (softmax ignores a
        # shift shared by all keys), so its float32 gradient is rounding noise, which Adam turns into steps of
        # size lr whose sign depends on the CPU's kernels: no two runs could agree on it
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True,
                                                               bias=False) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 40, (48, 12), generator=g), torch.randint(0, 5, (48,), generator=g)), None


job = rpcmp.Job(model=Transformer, stages=rpcmp.SplitAt("layers.1", "layers.2"), data=data, batch_size=12,
                microbatches=4, loss=nn.functional.cross_entropy, optimizer=(torch.optim.SGD, {"lr": 0.05}))
