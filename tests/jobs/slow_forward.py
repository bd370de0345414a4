"""A 3-stage MLP whose first stage computes slowly, layer by layer (``SLOW_FORWARD_S`` seconds a layer, 0 by
default), each layer's call written as "process-id layer" to the file ``SLOW_FORWARD_LOG`` names: a forward a
test finds running when it kills another owner (see [Note: a rollback stops the failed step's forward] in
rpcmp/owner/move.py). The pause changes no value."""
import os
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp

LAYERS = 10
PAUSE = float(os.environ.get("SLOW_FORWARD_S", "0"))
LOG = os.environ.get("SLOW_FORWARD_LOG")


class Slow(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index, self.lin = index, nn.Linear(16, 16)

    def forward(self, x):
        if not x.is_meta:
            if LOG:
                with open(LOG, "a") as f:
                    f.write(f"{os.getpid()} {self.index}\n")
            time.sleep(PAUSE)
        return torch.tanh(self.lin(x))


def model() -> nn.Sequential:
    return nn.Sequential(*[Slow(i) for i in range(LAYERS)], nn.Linear(16, 16), nn.Linear(16, 8))


def data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 16, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :8] * 2)), None


job = rpcmp.Job(model=model, stages=rpcmp.Split([LAYERS, 1, 1]), batch_size=16, microbatches=1, data=data, epochs=10,
                optimizer=(torch.optim.Adam, {"lr": 1e-3}), loss=nn.functional.mse_loss, hang_timeout=60)
