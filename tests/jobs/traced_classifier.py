"""A classifier with a functional ReLU in forward, cut on the traced graph with SplitAt."""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import rpcmp


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 8, (32,), generator=g)), None


job = rpcmp.Job(model=Classifier, stages=rpcmp.SplitAt("fc2"), data=data, batch_size=8, microbatches=4,
                loss=nn.functional.cross_entropy, optimizer=(torch.optim.SGD, {"lr": 0.05}))
