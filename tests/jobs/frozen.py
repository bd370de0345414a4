"""The MLP job with a stage that reads its input only detached (a frozen feature, a hard decision): the
layers before it get no gradient, as in the unsplit model, in pipeline and in DDP mode."""
import dataclasses

from torch import nn

import rpcmp
from mlp import job as mlp_job


class Detached(nn.Module):
    def forward(self, x):
        return x.detach().tanh()


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), Detached(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 8))


job = dataclasses.replace(mlp_job, model=model, stages=rpcmp.Split([2, 3, 2]))
