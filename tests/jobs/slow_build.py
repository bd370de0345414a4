"""An MLP whose factory sleeps between layers, two stages on one process: builds that
run at once on two RPC threads would interleave the global RNG."""
import time

import torch
from torch import nn

import rpcmp


def slow_mlp() -> nn.Sequential:
    layers = []
    for i in range(4):
        layers.append(nn.Linear(16, 16))
        time.sleep(0.02)
    return nn.Sequential(*layers)


job = rpcmp.Job(model=slow_mlp, stages=rpcmp.Split([2, 2]), placement=["worker1/cpu", "worker1/cpu"],
                batch_size=8, microbatches=2, optimizer=(torch.optim.SGD, {"lr": 0.1}),
                loss=nn.functional.mse_loss)
