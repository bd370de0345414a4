"""A 7-layer MLP with LayerNorm (a norm layer that does not mix samples), on a learnable
synthetic regression, so that `rpcmp run` and torchrun can train it end to end."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(),
        nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, 32), nn.Linear(32, 8),
    )


def data():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 8, generator=g)
    x = torch.randn(320, 16, generator=g)
    y = torch.tanh(x @ w)
    return TensorDataset(x[:256], y[:256]), TensorDataset(x[256:], y[256:])


def neg_mse(out, y):
    return -nn.functional.mse_loss(out, y).item()


job = rpcmp.Job(model=mlp, stages=rpcmp.Split([3, 4]), batch_size=8, microbatches=2, data=data,
                metric=neg_mse, metric_name="-MSE", optimizer=(torch.optim.SGD, {"lr": 0.1}),
                loss=nn.functional.mse_loss)
