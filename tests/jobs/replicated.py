"""Two copies of a 2-stage MLP with dropout in each stage, BatchNorm in
the second and Adam (``replicas=2``): what a lost copy's stage,
rebuilt from the live copy, must equal exactly (parameters, running
statistics, optimizer state, generators)."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Dropout(0.1),
                         nn.Linear(64, 64), nn.GELU(), nn.BatchNorm1d(64), nn.Dropout(0.1), nn.Linear(64, 8))


def data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(512, 16, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :8] * 2)), None


job = rpcmp.Job(model=model, stages=rpcmp.Split([3, 5]), replicas=2, batch_size=16, microbatches=2, data=data,
                epochs=100, optimizer=(torch.optim.Adam, {"lr": 1e-3}), loss=nn.functional.mse_loss, hang_timeout=60)
