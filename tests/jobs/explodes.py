"""A 3-stage MLP whose last layer fails in its forward pass on the first training step,
with that stage on the master (EXPLODE_ON=master, the default) or on a worker."""
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp


class Explodes(nn.Module):
    def forward(self, x):
        if self.training:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (8192x1 and 512x10)")
        return x


def model():
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8), Explodes())


def data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g)
    return TensorDataset(x, y), None


last = "master/cpu" if os.environ.get("EXPLODE_ON", "master") == "master" else "worker1/cpu"
job = rpcmp.Job(model=model, stages=rpcmp.Split([2, 1, 1]), placement=["worker1/cpu", "worker2/cpu", last],
                data=data, loss=nn.functional.mse_loss, batch_size=8, microbatches=2,
                optimizer=(torch.optim.SGD, {"lr": 0.1}))
