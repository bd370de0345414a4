"""Eight equal blocks cut unevenly (1, 5, 2): what Job(rebalance=True) re-cuts while it trains."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp


def model() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)])


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 256, generator=g)
    return TensorDataset(x, torch.tanh(x.roll(1, dims=1))), None


job = rpcmp.Job(model=model, stages=rpcmp.Split([1, 5, 2]), batch_size=64, microbatches=4, data=data, epochs=100,
                optimizer=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), loss=nn.functional.mse_loss)
