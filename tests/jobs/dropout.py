"""An MLP with dropout in both stages: resuming exactly needs every process's RNG state."""
import torch
from torch import nn

import rpcmp
from mlp import data


def dropout_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 32),
                         nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 8))


job = rpcmp.Job(model=dropout_mlp, stages=rpcmp.Split([3, 4]), batch_size=8, microbatches=2, data=data,
                optimizer=(torch.optim.SGD, {"lr": 0.1}), loss=nn.functional.mse_loss)
