"""tests/jobs/gated_decay.py cut by names: the first child returns ``(h, g)``, the second reads ``g`` only through
``g > 0``. AdamW's weight decay must leave the gate alone, as in the unsplit model, where it gets no gradient."""
import torch
from codes import data
from torch import nn

import rpcmp


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.gate = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.inp(x), self.gate(x)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.mid, self.out = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, hg):
        h, g = hg
        return self.out(self.mid(h) * (g > 0))


class GatedNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Gate(), Head()

    def forward(self, x):
        return self.second(self.first(x))


job = rpcmp.Job(model=GatedNames, stages=["first", "second"], data=data, batch_size=8, microbatches=2,
                loss=nn.functional.mse_loss, optimizer=(torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.5}))
