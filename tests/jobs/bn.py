"""A 7-layer MLP with two BatchNorm layers (one per stage), for BatchNorm under micro-batching."""
import torch
from torch import nn

import rpcmp


def bn_mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
        nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 8),
    )


job = rpcmp.Job(model=bn_mlp, stages=rpcmp.Split([3, 4]), batch_size=8, microbatches=4,
                optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), loss=nn.functional.mse_loss)
