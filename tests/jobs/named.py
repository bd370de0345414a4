"""A model of three named parts cut by name, with dropout in two of them (moving a stage must
carry its process's random number generators) and Adam."""
from collections import OrderedDict

import torch
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp


def model() -> nn.Sequential:
    return nn.Sequential(OrderedDict(
        embed=nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Dropout(0.1)),
        body=nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1)),
        head=nn.Linear(32, 8),
    ))


def data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 16, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :8])), None


job = rpcmp.Job(model=model, stages=["embed", "body", "head"], batch_size=8, microbatches=2, data=data,
                optimizer=(torch.optim.Adam, {"lr": 1e-2}), loss=nn.functional.mse_loss)
