from torch import nn

import rpcmp


class Scalar(nn.Module):
    def forward(self, x):
        return {"feats": x, "score": float(x.sum())}  # a float cannot be a stage output


job = rpcmp.Job(stages=[nn.Linear(4, 4), Scalar(), nn.Identity()], batch_size=4, microbatches=2,
                loss=lambda out, y: out.sum())
