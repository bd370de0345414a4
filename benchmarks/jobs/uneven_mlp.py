"""The bench MLP as 8 blocks (Linear 1024 + ReLU), cut by BALANCE (default 1,5,2): benchmarks/rebalance.py."""
import os

import rpcmp
import torch
from bench_models import SGD, mse
from torch import nn
from torch.utils.data import TensorDataset


def model():
    return nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(8)])


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 1024, generator=g)
    return TensorDataset(x, x.roll(1, dims=1)), None


balance = [int(b) for b in os.environ.get("BALANCE", "1,5,2").split(",")]
job = rpcmp.Job(model=model, stages=rpcmp.Split(balance), batch_size=256, microbatches=4, data=data, epochs=100,
                optimizer=SGD, loss=mse)
