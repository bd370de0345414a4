"""tests/jobs/paced_slow_keep.py's job (its slow keep of a snapshot) with a first layer that sleeps ``SLOW_EVAL_S``
seconds (in its environment; 0: none) in the first held-out forward after training began, once per process: an
owner killed from outside then dies in the middle of an evaluation. The sleep changes no value."""
import dataclasses
import os
import time

from torch import nn

import rpcmp
from mlp import mlp
from paced_slow_keep import job as slow_keep_job

SLEEP = float(os.environ.get("SLOW_EVAL_S", "0"))


class SlowInEvaluation(nn.Module):
    trained = slept = False

    def forward(self, x):
        if self.training:
            SlowInEvaluation.trained = True
        elif SLEEP and SlowInEvaluation.trained and not SlowInEvaluation.slept:
            SlowInEvaluation.slept = True
            time.sleep(SLEEP)
        return x


def model() -> nn.Sequential:
    return nn.Sequential(SlowInEvaluation(), *mlp())


job = dataclasses.replace(slow_keep_job, model=model, stages=rpcmp.Split([4, 4]))
