"""A 3-stage MLP with dropout in the middle stage and AdamW over two parameter groups, each with a
learning rate a scheduler moves its own way: what a lost owner's recovery must restore exactly
(parameters, optimizer state and each group's settings, the generators of the process that held it)."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp


def model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(),
        nn.Linear(64, 64), nn.Dropout(0.1),
        nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8),
    )


def data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(512, 16, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :8] * 2)), None


def groups(model):  # no weight decay off the matrices, and a learning rate of their own
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3}]


def warm_up(step):
    return min(1.0, (step + 1) / 20)


def decay(step):
    return 0.98 ** step


job = rpcmp.Job(model=model, stages=rpcmp.Split([2, 2, 3]), batch_size=16, microbatches=2, data=data, epochs=100,
                optimizer=(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.05}), param_groups=groups,
                scheduler=(torch.optim.lr_scheduler.LambdaLR, {"lr_lambda": [warm_up, decay]}),
                loss=nn.functional.mse_loss, hang_timeout=60)
