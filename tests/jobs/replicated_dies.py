"""tests/jobs/replicated.py whose process DIE_IN_STEP=NAME:K names is SIGKILLed inside its K-th
optimizer step, before it updates anything: after the copies met and averaged their gradients,
while the other copy steps. Without DIE_IN_STEP, nobody dies (the uninterrupted run)."""
import dataclasses
import multiprocessing
import os
import signal

import torch
from replicated import job as replicated

import rpcmp


class Adam(torch.optim.Adam):
    steps = 0

    def step(self, closure=None):
        self.steps += 1
        name, _, k = os.environ.get("DIE_IN_STEP", "").partition(":")
        if multiprocessing.current_process().name == name and self.steps == int(k):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(closure)


job: rpcmp.Job = dataclasses.replace(replicated, optimizer=(Adam, {"lr": 1e-3}))
