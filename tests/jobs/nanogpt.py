"""A nanoGPT-style decoder written the usual way: token + positional embedding added in forward,
causal scaled_dot_product_attention, LayerNorm, GELU, the head tied to the token embedding."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp

VOCAB, CONTEXT = 64, 32


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, width=32, depth=4, heads=4):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(CONTEXT, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # weight tying, as GPT-2 and nanoGPT do

    def forward(self, idx):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def data():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (48, 17), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:]), None


job = rpcmp.Job(model=GPT, stages=rpcmp.SplitAt("blocks.1", "blocks.3", lengths="any"), data=data, batch_size=8, microbatches=4,
                loss=lm_loss, optimizer=(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
                hang_timeout=60)  # tracing a stage under load: see the note in tests/integration/test_language_models.py
