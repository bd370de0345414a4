"""A traced stage that reads one of its received values only through a comparison (a gate made from another
value's sign) and the other through differentiable ops; tests/jobs/codes.py's data."""
import torch
from codes import data
from torch import nn

import rpcmp


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.gate, self.mid = (nn.Linear(16, 16) for _ in range(3))
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        h, g = self.inp(x), self.gate(x)
        return self.out(self.mid(h) * (g > 0))


job = rpcmp.Job(model=Gated, stages=rpcmp.SplitAt("mid"), data=data, batch_size=8, microbatches=2,
                loss=nn.functional.mse_loss, optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
