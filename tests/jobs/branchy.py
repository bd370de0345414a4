"""A model whose first layer uses its scale only on inputs with a positive sum, and never uses
its bias: copies of a replicated pipeline that see shares of other signs use other parameters."""
import torch
from torch import nn

import rpcmp


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.bias = nn.Parameter(torch.zeros(16))  # never used

    def forward(self, x):
        return x * self.scale if x.sum() > 0 else x


def model() -> nn.Sequential:
    return nn.Sequential(Gate(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


job = rpcmp.Job(model=model, stages=rpcmp.Split([2, 2]), batch_size=8, microbatches=2,
                optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), loss=nn.functional.mse_loss)
