"""tests/jobs/gated.py with the gate posted past a stage: the last stage reads the value the first posts to it only
through a comparison, and the chain value from the stage before through differentiable ops. Trained with AdamW's
weight decay: the gate gets no gradient in the unsplit model, so its weights must not decay in the split one."""
import dataclasses

import torch

import rpcmp
from gated import Gated, job as gated_job


class GatedPost(Gated):
    def forward(self, x):
        h, g = self.inp(x), self.gate(x)
        return self.out(self.mid(h)) * (g[:, :8] > 0)


job = dataclasses.replace(gated_job, model=GatedPost, stages=rpcmp.SplitAt("mid", "out"),
                          optimizer=(torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.5}))
