"""tests/jobs/mlp.py with a layer whose third training forward on its owner blocks forever, idle (as a
forward waiting on a lock, a queue or a read that never returns): every process still answers, and no
process works. See [Note: a stalled step] in rpcmp/core/stall.py."""
import dataclasses
import multiprocessing
import threading

from mlp import job as mlp_job, mlp
from torch import nn

import rpcmp


class Blocks(nn.Module):
    calls = 0

    def forward(self, x):
        if self.training and not x.is_meta and multiprocessing.current_process().name.startswith("worker"):
            Blocks.calls += 1
            if Blocks.calls == 3:
                threading.Event().wait()
        return x


def model() -> nn.Sequential:
    layers = mlp()
    return nn.Sequential(*layers[:4], Blocks(), *layers[4:])


job = dataclasses.replace(mlp_job, model=model, stages=rpcmp.Split([4, 4]), microbatches=1, epochs=100)
