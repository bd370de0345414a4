"""tests/jobs/mlp.py with a layer that ends its process, worker1, at the first held-out
evaluation after training began (the end of epoch 1), with DIE_UNTRAINED=1 at its first
forward in eval mode (a prediction), with DIE_AT_BUILD=1 as worker1 builds its stage: a
worker lost outside a training step. NEVER_DIE=1: the same job, nobody dies."""
import multiprocessing
import os

from mlp import data, job as mlp_job, mlp, neg_mse
from torch import nn

import rpcmp


def _worker1() -> bool:
    return multiprocessing.current_process().name == "worker1" and not os.environ.get("NEVER_DIE")


class DiesInEvaluation(nn.Module):
    trained = False

    def __init__(self):
        super().__init__()
        if os.environ.get("DIE_AT_BUILD") and _worker1():
            os._exit(1)

    def forward(self, x):
        if self.training:
            self.trained = True
        elif (self.trained or os.environ.get("DIE_UNTRAINED")) and _worker1():
            os._exit(1)
        return x


def model() -> nn.Sequential:
    return nn.Sequential(DiesInEvaluation(), *mlp())


job = rpcmp.Job(model=model, stages=rpcmp.Split([4, 4]), batch_size=8, microbatches=2, data=data,
                metric=neg_mse, metric_name="-MSE", optimizer=mlp_job.optimizer, loss=mlp_job.loss, epochs=3)
