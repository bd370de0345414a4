"""The MLP job with a running mean of its own in each stage (an EMA buffer its training forward writes, no module
rpcmp knows by kind): trained once a batch, as by the unsplit model, and taken from copy 0 by every copy. Other
tests put ``RunningMean`` into models of their own (it averages over every dimension but the features)."""
import dataclasses

import torch
from torch import nn

import rpcmp
from mlp import job as mlp_job


class RunningMean(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.flatten(0, -2).mean(0))
        return x - self.mean


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), RunningMean(32), nn.Tanh(), nn.Linear(32, 32), RunningMean(32), nn.Tanh(),
                         nn.Linear(32, 8))


job = dataclasses.replace(mlp_job, model=model, stages=rpcmp.Split([3, 4]))
