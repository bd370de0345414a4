"""tests/jobs/mlp.py with a first layer that stalls worker1's forward for 90 s once the file named by
STALL_FLAG exists (it creates STALL_FLAG + ".stalled" first): the work of a step upstream of a stage
whose owner is then lost."""
import dataclasses
import multiprocessing
import os
import time

from mlp import job as mlp_job, mlp
from torch import nn

import rpcmp


class Stalls(nn.Module):
    def forward(self, x):
        flag = os.environ.get("STALL_FLAG", "")
        if flag and os.path.exists(flag) and multiprocessing.current_process().name == "worker1":
            open(flag + ".stalled", "w").close()
            time.sleep(90)
        return x


def model() -> nn.Sequential:
    return nn.Sequential(Stalls(), *mlp())


job = dataclasses.replace(mlp_job, model=model, stages=rpcmp.Split([4, 4]), epochs=200)
