"""mlp.py's job with the master pausing ``PACED_STEP_S`` seconds a step (0: none) while it computes the
loss: a run that a test acts on while it trains (a drain, a re-cut, a stop by signal) trains a few steps a
second instead of hundreds, and a busy machine does not make it train more. The pause changes no value."""
import dataclasses
import os
import time

from torch import nn

from mlp import job as mlp_job

PAUSE = float(os.environ.get("PACED_STEP_S", "0")) / mlp_job.microbatches


def paced_mse(out, y):
    if PAUSE:
        time.sleep(PAUSE)
    return nn.functional.mse_loss(out, y)


job = dataclasses.replace(mlp_job, loss=paced_mse)
