"""A hard decision in the middle of a traced model: a stage that outputs only ``argmax`` codes, an
embedding of them after the cut, and the stage before the codes' in the master's process. No floating
tensor crosses the second cut, so nothing can carry a gradient back to the first stage: the unsplit
model gives it none, and the run must not wait for one."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import rpcmp


class Codes(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid = nn.Linear(16, 16), nn.Linear(16, 32)
        self.emb, self.out = nn.Embedding(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.out(self.emb(self.mid(self.inp(x)).argmax(-1)))


def data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 16, generator=g)
    return TensorDataset(x, torch.randn(64, 8, generator=g)), None


job = rpcmp.Job(model=Codes, stages=rpcmp.SplitAt("mid", "emb"), data=data, batch_size=8, microbatches=2,
                placement=["master/cpu", "worker1/cpu", "worker2/cpu"], loss=nn.functional.mse_loss,
                optimizer=(torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1}))
