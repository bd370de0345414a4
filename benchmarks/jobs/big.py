"""A model too big to hold whole in each process: 6 x Linear(7168, 7168) with GELU between, 308 M
parameters, ~4.6 GiB with their gradients and Adam's two moments (benchmarks/memory.py)."""
import os

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import rpcmp

WIDTH, DEPTH = int(os.environ.get("RPCMP_BIG_WIDTH", 7168)), 6


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(24, WIDTH, generator=g), torch.randn(24, WIDTH, generator=g)), None


job = rpcmp.Job(model=Big, stages=rpcmp.SplitAt("layers.2", "layers.4"), data=data, batch_size=8, microbatches=1,
                loss=F.mse_loss, optimizer=(torch.optim.Adam, {"lr": 1e-4, "fused": True}), max_steps=2, checkpoint_every=2,
                keep_last=1, threads=1)
# One micro-batch: the weights dominate memory here, and every further micro-batch costs a transient of
# weight-gradient size (benchmarks/memory.py measures M = 2 and 4 too).
# fused Adam (here and in the one-process reference): the plain CPU Adam allocates two temporaries of the
# size of the largest parameter per step (sqrt, then the division), 392 MiB here in every process.
