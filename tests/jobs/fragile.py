import torch
from torch import nn

import rpcmp


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("backward exploded")


class Fragile(nn.Module):
    def forward(self, x):
        return Boom.apply(x)


job = rpcmp.Job(stages=[nn.Linear(4, 4), Fragile(), nn.Linear(4, 4)], batch_size=8, microbatches=4,
                loss=lambda out, y: out.pow(2).mean(), optimizer=(torch.optim.SGD, {"lr": 0.01}))
